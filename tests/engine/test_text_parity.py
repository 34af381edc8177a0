"""Greedy parity with HF generate, token for token, under chunked prefill, preemption and prefix sharing."""

import pytest

from tests.engine.conftest import hf_greedy, varied_prompts
from vlserve import LLM, SamplingParams

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

MAX_NEW = 12


def _greedy():
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts_and_oracle(qwen2_dir):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(qwen2_dir).vocab_size
    prompts = varied_prompts(vocab)
    return prompts, hf_greedy(qwen2_dir, prompts, MAX_NEW)


def _check(llm, prompts, expected):
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}) diverged: {g} vs HF {e}"
    llm.check_integrity()
    return outs


def test_parity_batch_of_varied_lengths(qwen2_dir, prompts_and_oracle):
    prompts, expected = prompts_and_oracle
    llm = LLM(qwen2_dir, dtype="float32", num_kv_blocks=256)
    outs = _check(llm, prompts, expected)
    assert len(set(tuple(e) for e in expected)) > 1 and len(set(expected[-1])) > 3  # the oracle is not degenerate
    m = llm.get_metrics()
    assert m["vlserve:generation_tokens_total"] == MAX_NEW * len(prompts)
    assert m["vlserve:prompt_tokens_total"] == sum(len(p) for p in prompts)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_parity_with_every_prefill_chunked(qwen2_dir, prompts_and_oracle):
    prompts, expected = prompts_and_oracle
    llm = LLM(qwen2_dir, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=16)
    _check(llm, prompts, expected)


def test_parity_under_forced_preemption(qwen2_dir, prompts_and_oracle):
    prompts, expected = prompts_and_oracle
    # 24 blocks x 16 = 384 slots, far less than the ~550 tokens the batch needs at once.
    llm = LLM(qwen2_dir, dtype="float32", num_kv_blocks=24, max_num_batched_tokens=64)
    _check(llm, prompts, expected)
    assert llm.get_metrics()["vlserve:num_preemptions_total"] > 0


def test_parity_with_shared_prefix_hits(qwen2_dir):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(qwen2_dir).vocab_size
    base = varied_prompts(vocab, lengths=(70,), seed=3)[0]
    prompts = [base + tail for tail in varied_prompts(vocab, lengths=(5, 9, 1), seed=4)]
    expected = hf_greedy(qwen2_dir, prompts, MAX_NEW)
    llm = LLM(qwen2_dir, dtype="float32", num_kv_blocks=128)
    _check(llm, prompts[:1], expected[:1])
    _check(llm, prompts[1:], expected[1:])
    m = llm.get_metrics()
    assert m["vlserve:prefix_cache_hits_total"] >= 2 * 64  # 4 full blocks of the shared 70 tokens, twice
    outs = _check(llm, prompts, expected)  # everything cached now
    assert all(o.num_cached_tokens >= 64 for o in outs)


def test_parity_llama_gqa_untied(llama_dir):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(llama_dir).vocab_size
    prompts = varied_prompts(vocab, lengths=(2, 33, 64))
    expected = hf_greedy(llama_dir, prompts, MAX_NEW)
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32)
    _check(llm, prompts, expected)


def test_text_prompts_and_detokenization(qwen2_dir):
    llm = LLM(qwen2_dir, dtype="float32", num_kv_blocks=64)
    tok = llm.get_tokenizer()
    outs = llm.generate(["Hello world", "The quick brown fox"], _greedy(), use_tqdm=False)
    for o in outs:
        assert o.prompt_token_ids == tok("".join(o.prompt))["input_ids"]
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
        assert o.metrics.first_token_time >= o.metrics.arrival_time
        assert o.metrics.finished_time >= o.metrics.first_token_time
