"""Fixtures for the structured-output tests: the demo model's real tokenizer (Qwen2 byte-level BPE, 467 tokens) and a
full-size one: a local Hugging Face cache's when there is one (never downloaded from a hub), else Mistral's Tekken
(131,072 tokens) built from the mistral_common wheel (`tests.support.tekken_tokenizer`, package registry only)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.structured_output.walks import DEMO_MODEL

# Full-size tokenizers tried from the local Hugging Face cache only (VLSERVE_TEST_TOKENIZER: a directory to use).
LOCAL_TOKENIZER_CANDIDATES = ("Qwen/Qwen2-VL-2B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", "gpt2")


@pytest.fixture(scope="session")
def demo_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@pytest.fixture(scope="session")
def big_tokenizer():
    """A real tokenizer of tens of thousands of tokens from this machine, or a skip."""
    from transformers import AutoTokenizer

    explicit = os.environ.get("VLSERVE_TEST_TOKENIZER")
    for name in ([explicit] if explicit else []) + list(LOCAL_TOKENIZER_CANDIDATES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
        except Exception:  # not cached here: try the next
            continue
        if len(tokenizer) > 10_000:
            return tokenizer
    from tests.support.tekken_tokenizer import tekken_tokenizer_dir

    try:
        return AutoTokenizer.from_pretrained(tekken_tokenizer_dir())
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:  # no package registry reachable
        pytest.skip(f"no full-size tokenizer on this machine and none could be built: {exc}")
