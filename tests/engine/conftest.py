"""Tiny random text checkpoints shared by the engine tests, and an HF greedy oracle."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    from vlserve.testing.checkpoints import build_text_checkpoint

    return build_text_checkpoint(str(tmp_path_factory.mktemp("qwen2")), arch="qwen2", num_layers=2)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    from vlserve.testing.checkpoints import build_text_checkpoint

    return build_text_checkpoint(str(tmp_path_factory.mktemp("llama")), arch="llama", num_heads=4, num_kv_heads=1,
                                 tie_word_embeddings=False)


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF transformers `generate` (greedy, float32, EOS ignored), one prompt at a time: the oracle.

    Runs on the device `LLM(device="auto")` picks (cuda when present), so both sides do the same math.
    """
    from vlserve.testing.hf_generate import hf_greedy_continuations

    return hf_greedy_continuations(model_dir, prompts, max_new_tokens,
                                   "cuda" if torch.cuda.is_available() else "cpu")


def varied_prompts(vocab_size: int, lengths=(1, 3, 17, 40, 95, 160), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]
