"""The embedded demo models, shipped as standard HF directories:

- "vlserve-demo" (vlserve/demo/model/): a small Qwen2-VL checkpoint trained on a synthetic world of colored shapes
  (vlserve.demo.world). Rebuild it with `python -m training.train --out vlserve/demo/model`; measure it
  with `python -m training.eval`.
- "vlserve-demo-audio" (vlserve/demo/audio_model/): a small Qwen2-Audio checkpoint trained on clips of beeps
  (vlserve.demo.audio_world). Rebuild it with `python -m training.train_audio --out
  vlserve/demo/audio_model`; measure it with `python -m training.eval_audio`.

This module only locates the checkpoints (and the vision demo's EAGLE head); the package also holds the demo worlds
(`world`, `audio_world`, `held_out`) and the tiny random checkpoints `make serve` falls back on and `vlserve bench`
builds (`checkpoints`, `vl_checkpoints`, `llava_checkpoints`, their `tokenizer`). None of it imports anything from
vlserve outside vlserve.demo, so `config` may use it.
"""

from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_DIR = os.path.join(_HERE, "model")
AUDIO_MODEL_DIR = os.path.join(_HERE, "audio_model")
EAGLE_DIR = os.path.join(MODEL_DIR, "eagle")  # its EAGLE draft head (python -m training.train_eagle)
# served name -> (checkpoint directory, the command that rebuilds it)
DEMO_MODELS = {
    "vlserve-demo": (MODEL_DIR, "python -m training.train --out {dir}"),
    "vlserve-demo-audio": (AUDIO_MODEL_DIR, "python -m training.train_audio --out {dir}"),
}
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json")


def demo_model_path(name: str) -> str:
    """The shipped checkpoint directory of the demo model `name` (a key of DEMO_MODELS); ValueError for another
    name, or (with how to build it) when the checkpoint is missing or incomplete."""
    if name not in DEMO_MODELS:
        raise ValueError(f"unknown demo model {name[:100]!r}; the demo models are {sorted(DEMO_MODELS)}")
    path, rebuild = DEMO_MODELS[name]
    missing = [f for f in _REQUIRED if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ValueError(
            f"the embedded demo model {name!r} is missing or incomplete at {path} (no "
            f"{', '.join(missing)}); build it with `{rebuild.format(dir=path)}`"
        )
    return path


def default_model_path() -> str:
    """The shipped vision demo checkpoint directory ("vlserve-demo"); ValueError if it is missing or incomplete."""
    return demo_model_path("vlserve-demo")


def default_draft_path(target: str | None) -> str | None:
    """The shipped EAGLE head when `target` is the embedded demo model and the head exists, else None."""
    if target is None or not os.path.isfile(os.path.join(EAGLE_DIR, "config.json")):
        return None
    return EAGLE_DIR if os.path.realpath(target) == os.path.realpath(MODEL_DIR) else None
