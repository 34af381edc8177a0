"""The LoRA tests' session fixture: tiny checkpoints, built once per arch (helpers: lora_helpers.py)."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from vlserve.demo.checkpoints import build_text_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """arch -> (model_dir, hf_config): a tiny float32 checkpoint per arch, built once."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            d = build_text_checkpoint(str(tmp_path_factory.mktemp(arch)), arch)
            cache[arch] = d, AutoConfig.from_pretrained(d)
        return cache[arch]

    return get
