"""Pipeline parallel over gloo stages (worker processes on this CPU): PP=2 greedy token for token with PP=1 and HF
under chunked prefill, preemption and prefix hits; TP=2 x PP=2 (four ranks); each stage holds only its layers
(weights and KV, sized per stage); an uneven $VLSERVE_PP_LAYER_PARTITION; PP=3 (a middle stage both receives and
sends); bad partitions and what PP does not support yet are ValueErrors before any process starts; a killed stage
fails the engine at once; n-gram drafts proposed and verified on the last stage (EAGLE refused)."""

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
from vlserve.distributed.pipeline import PARTITION_ENV, layer_partition
from vlserve.executor import WorkerDied

MAX_NEW = 12


@pytest.fixture(scope="module")
def qwen2_4l_dir(tmp_path_factory):
    from vlserve.demo.checkpoints import build_text_checkpoint

    return build_text_checkpoint(str(tmp_path_factory.mktemp("qwen2_4l")), arch="qwen2", num_layers=4)


@pytest.fixture(scope="module")
def llama_4l_dir(tmp_path_factory):
    from vlserve.demo.checkpoints import build_text_checkpoint

    return build_text_checkpoint(
        str(tmp_path_factory.mktemp("llama_4l")),
        arch="llama",
        num_layers=4,
        num_heads=4,
        num_kv_heads=1,
        tie_word_embeddings=False,
    )


def _greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _tokens(llm, prompts, n: int = MAX_NEW) -> list[list[int]]:
    return greedy_tokens(llm, prompts, n)


def _num_params(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@pytest.mark.slow  # two stage processes (~10 s on 2 cores)
def test_pp2_equals_pp1_and_hf_with_chunks_preemption_and_prefix_hits(qwen2_4l_dir):
    prompts = varied_prompts(vocab_size(qwen2_4l_dir))
    expected = hf_greedy(qwen2_4l_dir, prompts, MAX_NEW)
    one = LLM(qwen2_4l_dir, dtype="float32", num_kv_blocks=256)
    assert _tokens(one, prompts) == expected
    full = _num_params(one.engine.runner.model)
    one.shutdown()
    # 24 blocks of 16 slots for a batch that needs ~550 at once: preemption; 64 tokens a step: the 95- and 160-token
    # prompts are prefilled in chunks
    llm = LLM(qwen2_4l_dir, dtype="float32", num_kv_blocks=24, max_num_batched_tokens=64, pipeline_parallel_size=2)
    try:
        info = llm.engine.executor.collective_rpc("shard_info")
        assert [(i["pp_rank"], i["pp_size"], i["world_size"]) for i in info] == [(0, 2, 1), (1, 2, 1)]
        assert [i["layers"] for i in info] == [(0, 2), (2, 4)]
        assert [i["num_kv_layers"] for i in info] == [2, 2]  # each stage caches only its own layers
        assert all(i["kv_cache_shape"] == (24, 16, 2, 16) for i in info)  # the same block count on both
        assert all(i["num_params"] < 0.75 * full for i in info), (info, full)  # the embeddings/lm_head + 2 layers
        check_exact_with_preemption_and_prefix_hits(llm, qwen2_4l_dir, prompts, expected, MAX_NEW, "PP=2")
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_uneven_partition_untied_llama_with_logprobs(llama_4l_dir, monkeypatch):
    monkeypatch.setenv(PARTITION_ENV, "1,3")
    prompts = varied_prompts(vocab_size(llama_4l_dir), lengths=(2, 33, 64))
    expected = hf_greedy(llama_4l_dir, prompts, MAX_NEW)
    # KV sized per stage: a block costs 2 (K, V) x 16 slots x 1 KV head x 16 dims x 4 bytes = 2 KiB per layer, so
    # this budget holds 150 blocks of stage 0's one layer, 50 of stage 1's three (37 of all four at PP=1)
    budget = 50 * 3 * 2048
    llm = LLM(llama_4l_dir, dtype="float32", kv_cache_memory_bytes=budget, pipeline_parallel_size=2)
    try:
        info = llm.engine.executor.collective_rpc("shard_info")
        assert [i["layers"] for i in info] == [(0, 1), (1, 4)]
        assert [i["num_kv_layers"] for i in info] == [1, 3]
        assert llm.engine.executor.num_blocks == 50  # the smaller stage's count, on every stage
        assert [i["kv_cache_shape"] for i in info] == [(50, 16, 1, 16)] * 2
        assert info[0]["num_params"] < info[1]["num_params"]  # embeddings + 1 layer vs 3 layers + norm + lm_head
        assert _tokens(llm, prompts) == expected
        out = llm.generate(
            prompts[:1], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2), use_tqdm=False
        )[0].outputs[0]
        assert out.token_ids == expected[0][:3]
        assert len(out.logprobs) == 3  # the last stage's output (it samples) is the step's
        llm.check_integrity()
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_profiled_kv_size_then_a_killed_stage_fails_the_engine(qwen2_4l_dir):
    # no KV size given: both stages profile a dummy prefill at once (handing its stream over), then size their pools
    llm = LLM(qwen2_4l_dir, dtype="float32", max_model_len=256, max_num_seqs=4, pipeline_parallel_size=2)
    try:
        assert llm.engine.executor.num_blocks == 4 * 256 // 16 + 1  # max_num_seqs x max_model_len, within memory
        prompts = varied_prompts(vocab_size(qwen2_4l_dir), lengths=(7,))
        assert _tokens(llm, prompts) == hf_greedy(qwen2_4l_dir, prompts, MAX_NEW)
        pids = [p.pid for p in llm.engine.executor.procs]
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDied, match=r"rank 1 \(pipeline stage 1\) \(pid \d+\) was killed by signal 9"):
            llm.generate(varied_prompts(vocab_size(qwen2_4l_dir), lengths=(40,)), _greedy(), use_tqdm=False)
        assert time.monotonic() - start < 20
    finally:
        llm.shutdown()


def test_layer_partition():
    assert layer_partition(4, 2, "") == [2, 2]
    assert layer_partition(5, 2, "") == [3, 2]  # even split, the first stages take the remainder
    assert layer_partition(24, 2, "10,14") == [10, 14]
    for spec, match in [
        ("1,2", "sums to 3 layers; the model has 4"),
        ("4,0", "at least one layer"),
        ("1,1,2", "has 3 stages"),
        ("a,b", "comma-separated layer counts"),
    ]:
        with pytest.raises(ValueError, match=match):
            layer_partition(4, 2, spec)
    with pytest.raises(ValueError, match="cannot split 4 decoder layers over 5"):
        layer_partition(4, 5, "")


def test_bad_partitions_and_unsupported_settings_are_refused(qwen2_4l_dir, monkeypatch):
    monkeypatch.setenv(PARTITION_ENV, "3,3")
    with pytest.raises(ValueError, match="sums to 6 layers; the model has 4"):
        LLM(qwen2_4l_dir, pipeline_parallel_size=2)
    monkeypatch.delenv(PARTITION_ENV)
    with pytest.raises(ValueError, match="cannot split 4 decoder layers over 8"):
        LLM(qwen2_4l_dir, pipeline_parallel_size=8)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1, got 0"):
        LLM(qwen2_4l_dir, pipeline_parallel_size=0)
    refused = [
        ({"distributed_executor_backend": "uni"}, "'uni' runs one rank"),
        ({"data_parallel_size": 2}, "with data_parallel_size > 1"),
        (
            {"speculative_config": {"method": "eagle", "num_speculative_tokens": 2, "model": "d"}},
            "with EAGLE speculative decoding .*use method 'ngram'",
        ),
        ({"speculative_config": {"num_speculative_tokens": 2, "model": "/ckpt/EAGLE3-x"}}, "with EAGLE"),
        ({"async_scheduling": True}, "with async_scheduling"),
        ({"enable_lora": True}, "with LoRA"),
        ({"compilation_config": 1}, "with torch.compile or CUDA graphs"),
    ]
    for kwargs, match in refused:
        with pytest.raises(ValueError, match=match):
            LLM(qwen2_4l_dir, pipeline_parallel_size=2, **kwargs)
    with pytest.raises(ValueError, match="Qwen2AudioForConditionalGeneration does not support pipeline_parallel_size"):
        LLM("vlserve-demo-audio", pipeline_parallel_size=2)  # the audio demo model: not split over stages yet


@pytest.mark.slow  # three stage processes on two cores
def test_pp3_middle_stage_receives_and_sends(qwen2_4l_dir):
    prompts = varied_prompts(vocab_size(qwen2_4l_dir), lengths=(3, 40, 95))
    llm = LLM(qwen2_4l_dir, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=48, pipeline_parallel_size=3)
    try:
        info = llm.engine.executor.collective_rpc("shard_info")
        assert [i["layers"] for i in info] == [(0, 2), (2, 3), (3, 4)]  # 4 layers: the first stage takes the extra
        assert [i["num_kv_layers"] for i in info] == [2, 1, 1]
        assert _tokens(llm, prompts) == hf_greedy(qwen2_4l_dir, prompts, MAX_NEW)
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_cli_flag_reaches_engine_args():
    from vlserve.cli import build_parser, serve_config_from_args

    args = build_parser().parse_args(["serve", "some-model", "-pp", "2"])
    engine_args, _ = serve_config_from_args(args)
    assert engine_args.pipeline_parallel_size == 2 and engine_args.world_size == 2
    args = build_parser().parse_args(["serve", "some-model", "--pipeline-parallel-size", "2", "-tp", "2"])
    engine_args, _ = serve_config_from_args(args)
    assert engine_args.world_size == 4  # TP x PP ranks


@pytest.mark.slow  # four rank processes on two cores
def test_tp2_x_pp2_matches_pp1_and_hf(qwen2_4l_dir):
    # tied embeddings: the last stage reads its vocab rows of the LM head from embed_tokens.weight
    prompts = varied_prompts(vocab_size(qwen2_4l_dir), lengths=(3, 40, 95))
    expected = hf_greedy(qwen2_4l_dir, prompts, MAX_NEW)
    one = LLM(qwen2_4l_dir, dtype="float32", num_kv_blocks=64)
    try:
        assert _tokens(one, prompts) == expected
    finally:
        one.shutdown()
    llm = LLM(
        qwen2_4l_dir,
        dtype="float32",
        num_kv_blocks=64,
        max_num_batched_tokens=48,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
    )
    try:
        info = llm.engine.executor.collective_rpc("shard_info")
        assert [(i["pp_rank"], i["rank"], i["world_size"]) for i in info] == [
            (0, 0, 2),
            (0, 1, 2),
            (1, 0, 2),
            (1, 1, 2),
        ]
        assert [i["layers"] for i in info] == [(0, 2), (0, 2), (2, 4), (2, 4)]
        assert all(i["kv_cache_shape"] == (64, 16, 1, 16) for i in info)  # 2 KV heads split over 2 ranks
        assert llm.engine.executor.output_rank == 2  # the last stage's first rank
        got = _tokens(llm, prompts)
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g == e, f"prompt {i} (len {len(prompts[i])}) diverged under TP=2 x PP=2: {g} vs HF {e}"
        llm.check_integrity()
    finally:
        llm.shutdown()


@pytest.mark.slow  # two stage processes
def test_pp2_ngram_drafts_verified_on_the_last_stage(tmp_path):
    # the last stage proposes (token ids only) and verifies; the drafts reach every stage in the SchedulerOutput and
    # the accepted tokens (several per request and step) are broadcast back. The 2-layer random model accepts a few.
    from tests.spec_decode.test_spec_engine import NGRAM, copy_heavy_prompts
    from vlserve.demo.checkpoints import build_text_checkpoint

    model_dir = build_text_checkpoint(str(tmp_path), arch="qwen2", num_layers=2)
    prompts = copy_heavy_prompts(8)
    expected = hf_greedy(model_dir, prompts, 24)
    spec_metrics = (
        "vlserve:spec_decode_num_drafts_total",
        "vlserve:spec_decode_num_draft_tokens_total",
        "vlserve:spec_decode_num_accepted_tokens_total",
    )
    one = LLM(model_dir, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32, speculative_config=NGRAM)
    try:
        assert _tokens(one, prompts, 24) == expected
        want = [one.get_metrics()[k] for k in spec_metrics]
    finally:
        one.shutdown()
    llm = LLM(
        model_dir,
        dtype="float32",
        num_kv_blocks=64,
        max_num_batched_tokens=32,
        pipeline_parallel_size=2,
        speculative_config=NGRAM,
    )
    try:
        got = _tokens(llm, prompts, 24)
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g == e, f"prompt {i} diverged under PP=2 with n-gram drafts: {g} vs HF {e}"
        m = llm.get_metrics()
        drafts, draft_tokens, accepted = (m[k] for k in spec_metrics)
        assert drafts > 0 and 0 < accepted <= draft_tokens
        assert [drafts, draft_tokens, accepted] == want  # the same drafts and verdicts as one process
        assert m["vlserve:generation_tokens_total"] == 24 * len(prompts)
        llm.check_integrity()
    finally:
        llm.shutdown()
