"""Shared helpers for model tests: a miniature "runner" driving a model over a paged KV cache, and HF references.

`PagedRunner` (tests.support.paged_runner) plays the model runner over a paged KV cache.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.paged_runner import PagedRunner


@pytest.fixture
def paged_runner():
    """The PagedRunner class."""
    return PagedRunner


def hf_model(model_dir: str, dtype=torch.float32):
    """The HF reference model (eager attention) from a checkpoint directory."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").eval()


@pytest.fixture
def load_hf():
    """Function (model_dir, dtype=float32) -> HF eager model in eval mode."""
    return hf_model


@pytest.fixture(scope="session")
def prompts():
    """Three prompts of different lengths (token ids from the test tokenizer)."""
    from vlserve.demo.checkpoints import _tokenizer

    tok = _tokenizer()
    texts = [
        "hello world",
        "The quick brown fox jumps over the lazy dog and the red circle moves left.",
        "Describe the image: a blue square, two green triangles and one yellow circle at the top left " * 2,
    ]
    return [tok(t)["input_ids"] for t in texts]
