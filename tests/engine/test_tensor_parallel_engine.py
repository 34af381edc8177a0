"""Tensor parallel over two gloo ranks (worker processes on this CPU): greedy token for token with TP=1 and HF under
chunked prefill, preemption, prefix hits and n-gram drafts; KV heads split (Qwen2) and replicated (Llama, one KV
head); each rank holds a shard; a killed rank fails the engine at once instead of hanging it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.engine.conftest import (
    check_exact_with_preemption_and_prefix_hits,
    greedy_tokens,
    hf_greedy,
    varied_prompts,
    vocab_size,
)
from vlserve import LLM, SamplingParams
from vlserve.executor import WorkerDied

pytestmark = pytest.mark.slow  # each TP engine starts two processes (~10 s on 2 cores)

MAX_NEW = 12


def _greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _tokens(llm, prompts, n: int = MAX_NEW) -> list[list[int]]:
    return greedy_tokens(llm, prompts, n)


def test_tp2_equals_tp1_and_hf_with_chunks_preemption_and_prefix_hits(qwen2_dir):
    prompts = varied_prompts(vocab_size(qwen2_dir))
    expected = hf_greedy(qwen2_dir, prompts, MAX_NEW)
    one = LLM(qwen2_dir, dtype="float32", num_kv_blocks=256)
    assert _tokens(one, prompts) == expected
    # 24 blocks of 16 slots for a batch that needs ~550 at once: preemption; 64 tokens a step: the 95- and 160-token
    # prompts are prefilled in chunks
    llm = LLM(qwen2_dir, dtype="float32", num_kv_blocks=24, max_num_batched_tokens=64, tensor_parallel_size=2)
    try:
        info = llm.engine.executor.collective_rpc("shard_info")
        full = sum(p.numel() for p in {id(p): p for p in one.engine.runner.model.parameters()}.values())
        assert [i["rank"] for i in info] == [0, 1] and all(i["world_size"] == 2 for i in info)
        assert all(i["num_params"] < 0.75 * full for i in info), (info, full)  # norms are replicated, the rest split
        assert all(i["kv_cache_shape"][2] == 1 for i in info)  # 2 KV heads over 2 ranks: one each
        check_exact_with_preemption_and_prefix_hits(llm, qwen2_dir, prompts, expected, MAX_NEW, "TP=2")
    finally:
        llm.shutdown()


def test_tp2_async_scheduling_equals_hf(qwen2_dir):
    """Async scheduling over ranks in other processes: step N+1 is sent to the ranks before step N's answers are
    collected and folded back; greedy output equals HF's."""
    prompts = varied_prompts(vocab_size(qwen2_dir), lengths=(2, 33, 64))
    expected = hf_greedy(qwen2_dir, prompts, MAX_NEW)
    llm = LLM(qwen2_dir, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2, async_scheduling=True)
    try:
        assert _tokens(llm, prompts) == expected
        ex = llm.engine.executor  # every step sent went through submit_execute and was collected
        assert llm.engine.steps_in_flight is not None and ex._num_sent == ex._num_collected > 0
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_tp2_replicates_a_single_kv_head_untied_llama(llama_dir):
    prompts = varied_prompts(vocab_size(llama_dir), lengths=(2, 33, 64))
    expected = hf_greedy(llama_dir, prompts, MAX_NEW)
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        assert all(i["kv_cache_shape"][2] == 1 for i in llm.engine.executor.collective_rpc("shard_info"))
        assert _tokens(llm, prompts) == expected
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_tp2_ngram_drafts_keep_greedy_output(qwen2_dir):
    from tests.spec_decode.test_spec_engine import NGRAM, copy_heavy_prompts

    prompts = copy_heavy_prompts(4)
    expected = hf_greedy(qwen2_dir, prompts, 24)
    llm = LLM(qwen2_dir, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2, speculative_config=NGRAM)
    try:
        assert _tokens(llm, prompts, 24) == expected
        m = llm.get_metrics()
        assert 0 < m["vlserve:spec_decode_num_accepted_tokens_total"] <= m["vlserve:spec_decode_num_draft_tokens_total"]
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_a_killed_rank_fails_the_engine_promptly(qwen2_dir):
    llm = LLM(qwen2_dir, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        pids = [p.pid for p in llm.engine.executor.procs]
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDied, match=r"tensor-parallel rank 1 \(pid \d+\) was killed by signal 9"):
            llm.generate(varied_prompts(vocab_size(qwen2_dir), lengths=(40,)), _greedy(), use_tqdm=False)
        assert time.monotonic() - start < 20
        time.sleep(0.5)
        assert not any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in pids)  # rank 0 was stopped too
        with pytest.raises(WorkerDied):  # the engine stays failed, it does not pretend to run
            llm.generate(varied_prompts(vocab_size(qwen2_dir), lengths=(3,)), _greedy(), use_tqdm=False)
    finally:
        llm.shutdown()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_bad_tensor_parallel_settings_are_refused(qwen2_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        LLM(qwen2_dir, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend must be 'mp' or 'ray'"):
        LLM(qwen2_dir, tensor_parallel_size=2, distributed_executor_backend="threads")
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        LLM(qwen2_dir, tensor_parallel_size=2, distributed_executor_backend="uni")
