"""EAGLE test targets: checkpoints rewritten so a draft head can match them, and a draft's config.json."""

from __future__ import annotations

import json
import os


def zero_attention_output(target_dir: str) -> None:
    """Rewrite a checkpoint in place with every o_proj zeroed (attention contributes nothing), so each token's
    hidden state depends on that token alone: a mimic head then reproduces the target exactly."""
    scale_attention_output(target_dir, 0.0)


def scale_attention_output(target_dir: str, factor: float) -> None:
    """Rewrite a checkpoint in place with every language-model o_proj multiplied by `factor` (< 1: the next
    token depends more on the current one, a target a small head can learn from little data)."""
    from safetensors.torch import load_file, save_file

    for f in os.listdir(target_dir):
        if f.endswith(".safetensors"):
            path = os.path.join(target_dir, f)
            tensors = load_file(path)
            for name in tensors:
                if "self_attn.o_proj." in name and "visual" not in name:
                    tensors[name] = tensors[name] * factor
            save_file(tensors, path, metadata={"format": "pt"})


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)
