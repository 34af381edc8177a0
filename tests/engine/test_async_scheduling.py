"""Async scheduling (step N+1 planned while step N runs) gives exactly the synchronous outputs and leaks nothing."""

import pytest
import torch
from PIL import Image

from tests.engine.conftest import varied_prompts
from tests.multimodal.mm_media import rand_image
from vlserve import LLM, SamplingParams
from vlserve.config import EngineArgs
from vlserve.engine.engine_loop import EngineLoop, NewRequest

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _prompts(model_dir):
    from transformers import AutoConfig

    return varied_prompts(AutoConfig.from_pretrained(model_dir).vocab_size, lengths=(1, 5, 17, 40, 70))


def _both(model_dir, prompts, params, **kw):
    """(sync outputs, async outputs, the async LLM) for the same prompts and engine settings."""
    kw = {"dtype": "float32", "num_kv_blocks": 256, **kw}
    sync = LLM(model_dir, **kw).generate(prompts, params, use_tqdm=False)
    async_llm = LLM(model_dir, async_scheduling=True, **kw)
    outs = async_llm.generate(prompts, params, use_tqdm=False)
    assert async_llm.engine.steps_in_flight is not None
    async_llm.check_integrity()  # no KV blocks or runner state left behind
    return sync, outs, async_llm


def _same(a, b):
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert y.outputs[0].token_ids == x.outputs[0].token_ids, f"request {i}"
        assert y.outputs[0].text == x.outputs[0].text, f"request {i}"
        assert y.outputs[0].finish_reason == x.outputs[0].finish_reason, f"request {i}"


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefill
        {"num_kv_blocks": 14, "max_num_batched_tokens": 64},  # forced preemption
    ],
    ids=["plain", "chunked", "preempt"],
)
def test_async_greedy_equals_sync(qwen2_dir, engine_kwargs):
    prompts = _prompts(qwen2_dir)
    sync, outs, llm = _both(
        qwen2_dir, prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), **engine_kwargs
    )
    _same(sync, outs)
    m = llm.get_metrics()
    assert m["vlserve:generation_tokens_total"] == 20 * len(prompts)
    # the decode steps took their input ids from the step before's samples on the device, not from the host
    assert llm.engine.executor.runner.token_feed.num_fed_tokens >= 15 * len(prompts)
    if "num_kv_blocks" in engine_kwargs:
        assert m["vlserve:num_preemptions_total"] > 0


def test_async_seeded_sampling_and_mixed_lengths_equal_sync(qwen2_dir):
    prompts = _prompts(qwen2_dir)
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=7 + i, max_tokens=3 + 5 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    sync, outs, _ = _both(qwen2_dir, prompts, params)
    _same(sync, outs)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3 + 5 * i for i in range(len(prompts))]


def test_async_penalties_min_tokens_and_logprobs_equal_sync(qwen2_dir):
    """Penalties count the output token sampled the step before (read back before sampling), min_tokens its count,
    and logprobs steps read their samples back at once; requests of each kind share the batch."""
    prompts = _prompts(qwen2_dir)
    params = [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, repetition_penalty=1.6),
        SamplingParams(temperature=0.0, max_tokens=14, frequency_penalty=1.5, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=14, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=14, min_tokens=10),
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
    ]
    sync, outs, llm = _both(qwen2_dir, prompts, params)
    _same(sync, outs)
    assert outs[2].outputs[0].logprobs == sync[2].outputs[0].logprobs
    plain = LLM(qwen2_dir, dtype="float32", num_kv_blocks=256).generate(
        prompts[:2], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True), use_tqdm=False
    )
    assert outs[0].outputs[0].token_ids != plain[0].outputs[0].token_ids  # the penalty changed the output
    assert llm.engine.executor.runner.token_feed.num_fed_tokens > 0


def test_async_stop_strings_and_stop_ids_equal_sync(qwen2_dir):
    prompts = _prompts(qwen2_dir)
    free = LLM(qwen2_dir, dtype="float32", num_kv_blocks=256).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    text = free[2].outputs[0].text
    stop_str = text[len(text) // 2 : len(text) // 2 + 2]  # found mid-run by the detokenizer
    stop_id = free[3].outputs[0].token_ids[5]
    params = SamplingParams(temperature=0.0, max_tokens=16, stop=[stop_str], stop_token_ids=[stop_id])
    sync, outs, _ = _both(qwen2_dir, prompts, params)
    _same(sync, outs)
    assert {o.outputs[0].finish_reason for o in outs} >= {"stop"}
    assert len(outs[2].outputs[0].token_ids) < 16


def test_async_ngram_spec_decode_equals_sync(qwen2_dir):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 600, (5 + i,), generator=g).tolist() * 4 for i in range(4)]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=11, max_tokens=18, ignore_eos=True),
    ):
        sync, outs, llm = _both(qwen2_dir, prompts, params, speculative_config=NGRAM, max_num_batched_tokens=32)
        _same(sync, outs)
        assert llm.get_metrics()["vlserve:spec_decode_num_drafts_total"] > 0


def test_async_qwen2_vl_with_images_equals_sync(tmp_path_factory):
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    model = build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("async_vl")))
    imgs = [[Image.fromarray(rand_image(56, 56, seed=s))] for s in range(3)]
    prompts = ["What is it?", "Describe the picture.", "Colors?"]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    kw = {"dtype": "float32", "num_kv_blocks": 256, "max_num_batched_tokens": 24}
    sync = LLM(model, **kw).generate(prompts, params, images=imgs, use_tqdm=False)
    llm = LLM(model, async_scheduling=True, **kw)
    _same(sync, llm.generate(prompts, params, images=imgs, use_tqdm=False))
    llm.check_integrity()


def test_async_abort_mid_run_leaks_nothing(qwen2_dir):
    prompts = _prompts(qwen2_dir)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sync = LLM(qwen2_dir, dtype="float32", num_kv_blocks=256).generate(prompts, params, use_tqdm=False)
    loop = EngineLoop(EngineArgs(model=qwen2_dir, dtype="float32", num_kv_blocks=256, async_scheduling=True))
    from vlserve.engine.input_processor import ProcessedPrompt

    loop.add_requests([NewRequest(str(i), ProcessedPrompt(None, p, []), params, 0.0) for i, p in enumerate(prompts)])
    finished, steps = {}, 0
    while loop.has_unfinished_requests():
        for out in loop.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps == 6:
            assert loop.core.steps_in_flight, "a step is queued while the caller processes outputs"
            aborted = loop.abort("1")
            assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
    assert "1" not in finished
    for i, want in enumerate(sync):
        if i != 1:
            assert finished[str(i)].outputs[0].token_ids == want.outputs[0].token_ids, f"request {i}"
    assert not loop.core.steps_in_flight
    loop.core.check_integrity()
    # Abort everything while steps are queued: the engine drains them and holds nothing.
    loop.add_requests([NewRequest("x", ProcessedPrompt(None, prompts[3], []), params, 0.0)])
    loop.step()
    loop.step()
    loop.abort("x")
    assert not loop.has_unfinished_requests() and not loop.core.steps_in_flight
    loop.core.check_integrity()


def test_async_beam_search_and_parallel_sampling_with_logprobs_equal_sync(qwen2_dir):
    """Beam search (logprobs every step) and n > 1 seeded sampling with logprobs: deferred read-backs carry the
    logprobs too, and the results equal the synchronous engine's."""
    from vlserve import BeamSearchParams

    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
    beam = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    params = SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=5, logprobs=2)
    got = {}
    for use_async in (False, True):
        llm = LLM(qwen2_dir, dtype="float32", num_kv_blocks=256, async_scheduling=use_async)
        beams = [[s.tokens for s in o.sequences] for o in llm.beam_search(prompts, beam)]
        samples = [
            [(c.token_ids, c.logprobs) for c in o.outputs]
            for o in llm.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False)
        ]
        got[use_async] = (beams, samples)
        llm.check_integrity()
    assert got[True] == got[False]
    assert all(len(c[0]) == 5 and len(c[1]) == 5 for o in got[True][1] for c in o)
    assert llm.engine.executor.runner.token_feed.num_fed_tokens > 0
