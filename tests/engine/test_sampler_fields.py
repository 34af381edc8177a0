"""logit_bias, allowed_token_ids, bad_words and prompt_logprobs through `LLM`, against HF transformers (float32)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import varied_prompts, vocab_size
from vlserve import LLM, SamplingParams
from vlserve.engine.logits_fields import bad_words_token_ids
from vlserve.worker.logits_adjustment import bad_word_bans

ENGINE_KW = dict(dtype="float32", max_model_len=512, num_kv_blocks=96, block_size=16, max_num_batched_tokens=24)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def llm(qwen2_dir):
    return LLM(qwen2_dir, **ENGINE_KW)  # 24-token steps: prompts over 24 tokens prefill in chunks


@pytest.fixture(scope="module")
def hf(qwen2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen2_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(qwen2_dir):
    return varied_prompts(vocab_size(qwen2_dir), lengths=(7, 40, 61), seed=11)


def hf_greedy_adjusted(hf, prompt: list[int], steps: int, adjust) -> list[int]:
    """HF's greedy continuation where `adjust(logits [V], outputs so far)` edits each step's logits first."""
    ids, out = list(prompt), []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        t = int(adjust(logits.clone(), out).argmax())
        out.append(t)
        ids.append(t)
    return out


def generate(llm, prompts, **params) -> list[list[int]]:
    sp = SamplingParams(ignore_eos=True, **params)
    return [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    ]


def test_logit_bias_matches_hf_and_forces_a_token(llm, hf, prompts):
    plain = generate(llm, prompts, temperature=0.0, max_tokens=6)
    for prompt, first in zip(prompts, plain):
        bias = {17: 2.0, first[1]: 3.5, first[0]: -100.0}  # (first[0] may equal first[1]: -100 wins)

        def add_bias(logits, _out, bias=bias):
            for t, b in bias.items():
                logits[t] += b
            return logits

        got = generate(llm, [prompt], temperature=0.0, max_tokens=6, logit_bias=bias)[0]
        assert got == hf_greedy_adjusted(hf, prompt, 6, add_bias)
        assert got[0] != first[0]
    # +100 wins over any logit of this model, greedy or sampled
    forced = generate(llm, prompts, temperature=1.0, seed=3, max_tokens=5, logit_bias={"42": 100})
    assert forced == [[42] * 5] * len(prompts)
    llm.check_integrity()


def test_allowed_token_ids_restrict_output(llm, hf, prompts):
    allowed = [5, 77, 300, 512, 640]

    def only_allowed(logits, _out):
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        return masked

    greedy = generate(llm, prompts, temperature=0.0, max_tokens=6, allowed_token_ids=allowed)
    assert greedy == [hf_greedy_adjusted(hf, p, 6, only_allowed) for p in prompts]
    sampled = generate(llm, prompts, temperature=1.5, seed=1, max_tokens=24, allowed_token_ids=allowed)
    assert all(t in allowed for seq in sampled for t in seq)
    assert len({t for seq in sampled for t in seq}) > 1  # really sampled among them


def test_bad_words_never_appear_and_match_hf(llm, hf, prompts, qwen2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen2_dir)
    plain = generate(llm, prompts, temperature=0.0, max_tokens=10)
    for prompt, seq in zip(prompts, plain):
        # a one-token word and a two-token word the model produces unrestricted
        words = [tok.decode([seq[0]]), tok.decode(seq[3:5])]
        sequences = bad_words_token_ids(words, tok)
        assert any(len(s) > 1 for s in sequences)

        def ban(logits, out, sequences=sequences):
            logits[bad_word_bans(sequences, out)] = float("-inf")
            return logits

        got = generate(llm, [prompt], temperature=0.0, max_tokens=10, bad_words=words)[0]
        assert got == hf_greedy_adjusted(hf, prompt, 10, ban)
        for s in sequences:
            assert not any(got[i : i + len(s)] == s for i in range(len(got) - len(s) + 1)), (s, got)


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # [P, V]: row i predicts token i + 1


def check_prompt_logprobs(entries, prompt, ref: torch.Tensor, k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        entry, row, tok = entries[i], ref[i - 1], prompt[i]
        assert abs(entry[tok].logprob - float(row[tok])) < 1e-4
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(k)
        for rank, (val, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert abs(entry[tid].logprob - val) < 1e-4
            if tid != tok:
                assert entry[tid].rank == rank
        assert len(entry) in (k, k + 1)


def test_prompt_logprobs_match_hf_with_chunked_prefill(llm, hf, prompts):
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=3, ignore_eos=True),
        use_tqdm=False,
    )
    for out, prompt in zip(outs, prompts):  # 40 and 61 tokens: prefilled over 2-3 steps of 24
        check_prompt_logprobs(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), 3)
        assert out.outputs[0].logprobs is None
    plain = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert plain[0].prompt_logprobs is None


def test_prompt_logprobs_skip_prefix_cache_hits(llm, hf, qwen2_dir):
    prompt = varied_prompts(vocab_size(qwen2_dir), lengths=(50,), seed=5)[0]
    warm = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    again = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0 and again.num_cached_tokens >= 32  # the prompt's blocks are cached
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[
        0
    ]
    assert out.num_cached_tokens == 0
    check_prompt_logprobs(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), 0)
    llm.check_integrity()


def test_prompt_logprobs_with_n_and_preemption(qwen2_dir, hf):
    """A pool too small for the batch preempts requests mid-way; each prompt's logprobs still come out once."""
    small = LLM(qwen2_dir, **{**ENGINE_KW, "num_kv_blocks": 14})
    prompts = varied_prompts(vocab_size(qwen2_dir), lengths=(45, 50, 55), seed=9)
    outs = small.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=40, prompt_logprobs=1, ignore_eos=True),
        use_tqdm=False,
    )
    assert small.get_metrics()["vlserve:num_preemptions_total"] > 0
    for out, prompt in zip(outs, prompts):
        check_prompt_logprobs(out.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), 1)
        assert [len(c.token_ids) for c in out.outputs] == [40, 40]
    small.check_integrity()


@pytest.mark.slow
def test_spec_decode_and_async_scheduling_apply_the_same_adjustment(qwen2_dir, llm, prompts):
    """The rejection sampler verifies drafts against the adjusted logits, and async scheduling reads the real
    output tokens for bad words: both give the plain engine's greedy tokens."""
    # a repetitive prompt gives the n-gram proposer drafts
    rep = (prompts[1][:6] * 6)[:36]
    cases = [
        dict(logit_bias={7: 4.0, 9: -3.0}),
        dict(allowed_token_ids=list(range(0, 689, 3))),
        dict(bad_words=["hello", " world"]),
    ]
    spec = LLM(qwen2_dir, speculative_config=NGRAM, **ENGINE_KW)
    async_llm = LLM(qwen2_dir, async_scheduling=True, **ENGINE_KW)
    for fields in cases:
        want = generate(llm, [rep, prompts[2]], temperature=0.0, max_tokens=12, **fields)
        assert generate(spec, [rep, prompts[2]], temperature=0.0, max_tokens=12, **fields) == want, fields
        assert generate(async_llm, [rep, prompts[2]], temperature=0.0, max_tokens=12, **fields) == want, fields
    assert spec.get_metrics().get("vlserve:spec_decode_num_draft_tokens_total", 1) > 0


def test_bad_values_are_value_errors(llm):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"3": 101})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"x": 1})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[""])
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    for fields in (dict(logit_bias={689: 1.0}), dict(allowed_token_ids=[1, 689])):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1, **fields), use_tqdm=False)
    assert generate(llm, [[1, 2, 3]], temperature=0.0, max_tokens=2) != []  # the engine still serves
