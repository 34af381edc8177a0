"""`make serve`: serve MODEL if given, else the embedded demo model, else a tiny random-weight Qwen2-VL.

    python -m vlserve.quickstart [MODEL] [-- extra `vlserve serve` flags]

The demo (no MODEL) runs its engine in a thread of the API process (`--no-engine-process`) unless the flags say
`--engine-process`: each Python process that imports torch costs about 0.5 GB here (a CUDA build of torch), so one
process keeps the demo server under 1 GB RSS where two take 1.6 GB. A given MODEL is served as `vlserve serve`
serves it (engine in its own process).
"""

from __future__ import annotations

import os
import sys

FALLBACK_DIR = os.path.join(".cache", "vlserve-random-qwen2-vl")


def pick_model(model: str | None) -> tuple[str, str | None]:
    """(checkpoint, served name): the given one, the demo model ("vlserve-demo"), or a random one built once into
    .cache/ ("vlserve-random")."""
    if model:
        return model, None
    try:
        from vlserve.demo import default_model_path

        return default_model_path(), "vlserve-demo"
    except (ImportError, ValueError) as e:
        print(
            f"[quickstart] {e}\n[quickstart] serving a tiny RANDOM-weight Qwen2-VL instead (answers are noise)",
            file=sys.stderr,
        )
    if not os.path.isfile(os.path.join(FALLBACK_DIR, "config.json")):
        from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

        build_qwen2_vl_checkpoint(
            FALLBACK_DIR,
            hidden_size=128,
            num_layers=2,
            vision_depth=2,
            vision_embed_dim=64,
            mrope_section=(4, 6, 6),
            initializer_range=0.02,
        )
    return FALLBACK_DIR, "vlserve-random"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    model = argv.pop(0) if argv and not argv[0].startswith("-") else None
    if argv and argv[0] == "--":
        argv = argv[1:]
    from vlserve.cli import main as cli_main

    path, name = pick_model(model)
    if name is not None and "--served-model-name" not in argv:
        argv = ["--served-model-name", name, *argv]
    if name is not None and "--engine-process" not in argv and "--no-engine-process" not in argv:
        argv = ["--no-engine-process", *argv]  # the demo: one process (see the module docstring)
    return cli_main(["serve", path, *argv])


if __name__ == "__main__":
    sys.exit(main())
