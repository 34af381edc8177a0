"""The embedded demo model "vlserve-demo": a small Qwen2-VL checkpoint trained on a synthetic world of colored
shapes (vlserve.training.world), shipped in vlserve/demo/model/ as a standard HF directory.

This module only locates the checkpoint (and its EAGLE head) and imports nothing from vlserve, so `config` may use
it. Rebuild the model with `python -m vlserve.training.train --out vlserve/demo/model`; measure it with
`python -m vlserve.training.eval`.
"""
from __future__ import annotations

import os

MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model")
EAGLE_DIR = os.path.join(MODEL_DIR, "eagle")  # its EAGLE draft head (vlserve train-eagle)
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json")


def default_model_path() -> str:
    """The shipped demo checkpoint directory; ValueError (with how to build it) if it is missing or incomplete."""
    missing = [f for f in _REQUIRED if not os.path.isfile(os.path.join(MODEL_DIR, f))]
    if missing:
        raise ValueError(f"the embedded demo model is missing or incomplete at {MODEL_DIR} (no {', '.join(missing)});"
                         f" build it with `python -m vlserve.training.train --out {MODEL_DIR}`")
    return MODEL_DIR


def default_draft_path(target: str | None) -> str | None:
    """The shipped EAGLE head when `target` is the embedded demo model and the head exists, else None."""
    if target is None or not os.path.isfile(os.path.join(EAGLE_DIR, "config.json")):
        return None
    return EAGLE_DIR if os.path.realpath(target) == os.path.realpath(MODEL_DIR) else None
