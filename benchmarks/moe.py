"""Qwen3-VL-MoE decoding on CPU: a locally built mixture-of-experts checkpoint (random weights, the real
processor and layout) through vlserve, transformers' generate and (optionally) vLLM-CPU, each in a fresh process.

    python -m benchmarks.moe [--model DIR | --build DIR] [--vllm-python PY] [--batches 1,8]

`--build` writes the default ~1.2B-total / ~0.2B-active model (12 layers of 64 experts, 8 per token, width 1024)
first. Every engine runs greedy with `ignore_eos` on the same random text prompts; tokens/s is the fastest of
`--repeats` runs after a warm-up; ratios are vlserve against each other engine on the same checkpoint, same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks.offline_case import run_case
from vlserve.bench.throughput import make_prompts

DEFAULT_MODEL = dict(
    hidden_size=1024,
    intermediate_size=2048,
    num_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    mrope_section=(16, 8, 8),
    vision_depth=4,
    vision_hidden_size=256,
    vision_num_heads=4,
    deepstack_visual_indexes=(1, 2),
    num_position_embeddings=64,
    initializer_range=0.02,
    moe={"num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 512},
)


def parameter_counts(model_dir: str) -> tuple[int, int]:
    """(total, active per token) parameters of a Qwen3-VL-MoE checkpoint's language model (experts counted k/E)."""
    from safetensors import safe_open

    cfg = json.load(open(os.path.join(model_dir, "config.json")))["text_config"]
    share = cfg["num_experts_per_tok"] / cfg.get("num_experts", cfg.get("num_local_experts"))  # 4.x / 5.x key
    total = active = 0
    for name in os.listdir(model_dir):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(model_dir, name), "pt") as f:
            for key in f.keys():
                if ".visual." in key or key.startswith("visual."):
                    continue
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= d
                total += n
                active += n * share if ".experts." in key else n
    return total, int(active)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="an existing Qwen3-VL-MoE checkpoint")
    where.add_argument("--build", help="build the default checkpoint here first")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--vllm-python", default=None, help="python of a venv with vLLM-CPU (skipped without)")
    args = p.parse_args(argv)
    import torch

    model = args.model
    if args.build:
        from tests.support.qwen3_vl_checkpoints import build_qwen3_vl_checkpoint

        model = build_qwen3_vl_checkpoint(args.build, **DEFAULT_MODEL)
    total, active = parameter_counts(model)
    batches = [int(b) for b in args.batches.split(",")]
    vocab = json.load(open(os.path.join(model, "config.json")))["text_config"]["vocab_size"]
    cfg = {
        "dtype": args.dtype,
        "batches": batches,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "prompts": make_prompts(max(batches), args.input_len, vocab, 0),
        "max_model_len": args.input_len + args.output_len + 16,
        "threads": args.threads or torch.get_num_threads(),
    }
    engines = [("vlserve", sys.executable), ("hf", sys.executable)]
    if args.vllm_python:
        engines.append(("vllm", args.vllm_python))
    results = {}
    for engine, python in engines:
        results[engine] = run_case(python, engine, model, cfg)
        print(f"# {engine}: {results[engine]}", flush=True)
    print(
        f"\n{model}: language model {total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active per token; "
        f"{args.dtype}, {cfg['threads']} threads, {args.input_len} in -> {args.output_len} out, greedy"
    )
    print("| engine | peak RSS GiB | " + " | ".join(f"tok/s b{b}" for b in batches) + " |")
    print("|" + "---|" * (2 + len(batches)))
    for engine, _ in engines:
        r = results[engine]
        if isinstance(r, str):
            print(f"| {engine} | {r} |")
        else:
            print(f"| {engine} | {r['rss_gib']:.2f} | " + " | ".join(f"{r[str(b)]:.2f}" for b in batches) + " |")
    ours = results["vlserve"]
    for engine, _ in engines[1:]:
        theirs = results[engine]
        if isinstance(ours, dict) and isinstance(theirs, dict):
            print(f"vlserve / {engine}: " + ", ".join(f"b{b} {ours[str(b)] / theirs[str(b)]:.2f}x" for b in batches))


if __name__ == "__main__":
    main()
