"""LLM API behaviour: sampling options end to end, stop conditions, n > 1, logprobs, and the bad-input table."""

import math

import pytest

from vlserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(qwen2_dir):
    return LLM(qwen2_dir, dtype="float32", num_kv_blocks=128, max_model_len=256, seed=0)


PROMPTS = ["Hello world", "The quick brown fox jumps", "What color is the circle?"]


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_seed_reproducible_and_top_k1_is_greedy(llm):
    sp = SamplingParams(temperature=1.0, seed=123, max_tokens=10, ignore_eos=True)
    a = llm.generate(PROMPTS, sp, use_tqdm=False)
    b = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert _tokens(a) == _tokens(b)
    other = llm.generate(
        PROMPTS, SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    assert _tokens(other) != _tokens(a)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    topk1 = llm.generate(
        PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    assert _tokens(greedy) == _tokens(topk1)
    llm.check_integrity()


def test_seeded_request_independent_of_batch(llm):
    sp = SamplingParams(temperature=0.8, seed=99, max_tokens=8, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], sp, use_tqdm=False)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    batched = llm.generate(PROMPTS, [noisy, sp, noisy], use_tqdm=False)[1].outputs[0].token_ids
    assert alone == batched


def test_n_samples_share_prompt_and_differ(llm):
    out = llm.generate(
        "Describe the image.",
        SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    llm.check_integrity()


def test_max_min_tokens_and_stop_token_ids(llm):
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    assert len(greedy.token_ids) == 6 and greedy.finish_reason == "length"
    stop_tok = greedy.token_ids[2]
    first = greedy.token_ids.index(stop_tok)
    stopped = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_tok]), use_tqdm=False
    )[0].outputs[0]
    assert stopped.token_ids == greedy.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_tok


def test_stop_strings_cut_text(llm):
    full = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    text = full.text
    assert len(text) > 4
    stop = text[2:4]
    cut = llm.generate(
        PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    kept = llm.generate(
        PROMPTS[2],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    llm.check_integrity()


def test_logprobs(llm):
    out = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and entry[tok].rank == 1  # greedy picks the top token
        assert 3 <= len(entry) <= 4
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert math.isclose(
        out.cumulative_logprob, sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)), rel_tol=1e-5
    )


def test_token_id_prompts(llm):
    out = llm.generate(
        [[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert [o.prompt_token_ids for o in out] == [[5, 6, 7], [8, 9]]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n must"),
        ({"logprobs": 50}, "logprobs"),
        ({"min_p": 2.0}, "min_p"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"temperature": float("nan")}, "finite"),
        ({"seed": 2**70}, "int64"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_leave_engine_usable(llm):
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["ok", [5] * 400], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[10**9]], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="text-only"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": b"not an image"}}, sp, use_tqdm=False)
    llm.check_integrity()
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(["still works"], sp, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_bad_model_paths(tmp_path, qwen2_dir):
    with pytest.raises(ValueError, match="not a local directory"):
        LLM(str(tmp_path / "missing"))
    (tmp_path / "noconfig").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path / "noconfig"))
    import json
    import shutil

    bad = tmp_path / "badarch"
    shutil.copytree(qwen2_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["MysteryForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="MysteryForCausalLM"):
        LLM(str(bad))


def test_kv_cache_sizing(qwen2_dir):
    from vlserve.core.kv_cache_manager import cdiv

    profiled = LLM(qwen2_dir, dtype="float32", max_model_len=256, max_num_seqs=4)
    n = profiled.get_metrics()["vlserve:num_kv_blocks"]
    assert cdiv(256, 16) <= n <= 4 * cdiv(256, 16) + 1  # at least one full-length sequence, at most the cap
    per_block = profiled.engine.runner.bytes_per_block()
    sized = LLM(qwen2_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=per_block * 20 + 5)
    assert sized.get_metrics()["vlserve:num_kv_blocks"] == 20
    assert len(profiled.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)) == 1
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        LLM(qwen2_dir, dtype="float32", kv_cache_memory_bytes=10)
