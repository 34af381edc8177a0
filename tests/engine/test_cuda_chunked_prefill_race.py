"""CUDA only: a long prompt prefilled in many chunks (steps that sample nothing, so nothing synchronizes with the
device between them) gives HF's greedy tokens. Before the step input buffers waited for their previous copy, the
next chunk's host writes could race the pending non_blocking copy of the last one (worker/input_batch.py)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import hf_greedy, varied_prompts
from vlserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the race needs a CUDA device")


def test_many_chunk_prefill_matches_hf_on_cuda(qwen2_dir):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(qwen2_dir).vocab_size
    prompts = varied_prompts(vocab, lengths=(700, 333), seed=7)
    expected = hf_greedy(qwen2_dir, prompts, 8)
    for level in (0, 2):  # eager, and compiled with decode graphs
        llm = LLM(
            qwen2_dir,
            dtype="float32",
            num_kv_blocks=256,
            max_num_batched_tokens=16,
            compilation_config={"level": level},
        )
        got = [
            o.outputs[0].token_ids
            for o in llm.generate(
                prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
            )
        ]
        assert got == expected, f"level {level}"
        llm.check_integrity()
