"""Gemma 3's KV cache groups end to end: a tiny random Gemma 3 text model (3 sliding layers with window 8, one full
layer) served with block size 4, so its sliding layers hand back blocks as a sequence runs past the window; greedy
tokens equal HF's through chunked prefill, prefix hits and preemption, and the same KV bytes hold a prompt the plain
layout refuses."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.support.gemma3_checkpoints import build_gemma3_text_checkpoint
from tests.support.hf_generate import hf_greedy_continuations
from vlserve import LLM, SamplingParams

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

MAX_NEW = 20
BS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_gemma3_text_checkpoint(str(tmp_path_factory.mktemp("gemma3kv")))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 500, (24,), generator=g).tolist()  # a common prefix: prefix hits past the window
    return [shared + torch.randint(3, 500, (n,), generator=g).tolist() for n in (30, 17, 41)]


@pytest.fixture(scope="module")
def hf_greedy(model_dir, prompts):
    return hf_greedy_continuations(model_dir, prompts, MAX_NEW, attn_implementation="eager")


def _generate(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_groups_and_bytes_per_block(model_dir):
    llm = LLM(model_dir, dtype="float32", block_size=BS, num_kv_blocks=64)
    groups = llm.engine.runner.kv_groups
    assert groups.windows == (None, 8, 8, 8) and groups.num_slots == 1
    kv = llm.engine.scheduler.kv
    assert kv.group_windows == (None, 8, 8, 8) and kv.pool.null_block is not None
    # one block id costs one layer page: a quarter of the plain layout's four
    cfg = llm.engine.runner.text_config
    page = 2 * BS * cfg.num_key_value_heads * cfg.head_dim * 4
    assert llm.engine.runner.bytes_per_block() == page


def test_greedy_equals_hf_across_chunks_prefix_hits_and_preemption(model_dir, prompts, hf_greedy):
    # chunks of 16 tokens; the second round reuses the first's blocks (prefix hits reach past the window)
    llm = LLM(model_dir, dtype="float32", block_size=BS, num_kv_blocks=200, max_num_batched_tokens=16)
    assert _generate(llm, prompts) == hf_greedy
    hits_before = llm.engine.scheduler.kv.prefix_hits
    assert _generate(llm, prompts) == hf_greedy
    assert llm.engine.scheduler.kv.prefix_hits > hits_before
    llm.engine.scheduler.check_integrity()
    # a pool too small for all three at once: requests are preempted and recomputed
    small = LLM(
        model_dir,
        dtype="float32",
        block_size=BS,
        num_kv_blocks=48,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    assert _generate(small, prompts) == hf_greedy
    assert small.engine.scheduler.stats.num_preemptions > 0
    small.engine.scheduler.check_integrity()


def _without_window(model_dir: str, out_dir: str) -> str:
    shutil.copytree(model_dir, out_dir)
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["layer_types"] = ["full_attention"] * len(cfg["layer_types"])
    with open(path, "w") as f:
        json.dump(cfg, f)
    return out_dir


def test_the_same_bytes_hold_a_prompt_the_plain_layout_refuses(model_dir, tmp_path):
    cfg_bytes = LLM(model_dir, dtype="float32", block_size=BS, num_kv_blocks=8).engine.runner.bytes_per_block()
    budget = 4 * cfg_bytes * 16  # 16 blocks of the plain layout (4 layer pages each): 64 tokens
    prompt = list(range(3, 103))  # 100 tokens
    full = LLM(
        _without_window(model_dir, str(tmp_path / "plain")),
        dtype="float32",
        block_size=BS,
        kv_cache_memory_bytes=budget,
        max_num_batched_tokens=16,
    )
    with pytest.raises(ValueError, match="KV cache holds only"):
        full.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4), use_tqdm=False)
    hybrid = LLM(model_dir, dtype="float32", block_size=BS, kv_cache_memory_bytes=budget, max_num_batched_tokens=16)
    out = hybrid.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    hybrid.engine.scheduler.check_integrity()
