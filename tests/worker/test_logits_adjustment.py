"""The logits-adjustment step: vLLM's bad-word rule, the adjustment built only for rows that use it, the Sampler's
greedy and random rows, and the rejection sampler verifying drafts against the same adjusted logits."""

from __future__ import annotations

import torch

from vlserve.sampling_params import SamplingParams
from vlserve.worker.logits_adjustment import apply_logits_adjustment, bad_word_bans, build_logits_adjustment
from vlserve.worker.rejection_sampler import RejectionSampler, build_spec_sampling_metadata
from vlserve.worker.sampler import Sampler, build_sampling_metadata

V = 32


def test_bad_word_bans_follow_vllm_rule():
    words = [[5], [7, 8], [1, 2, 3]]
    assert bad_word_bans(words, []) == [5]  # a multi-token word needs its prefix in the outputs
    assert bad_word_bans(words, [4, 7]) == [5, 8]
    assert bad_word_bans(words, [7, 4]) == [5]
    assert bad_word_bans(words, [9, 1, 2]) == [5, 3]
    assert bad_word_bans(words, [2]) == [5]  # only the last tokens count


def test_no_adjustment_when_no_row_uses_one():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=3)]
    assert build_logits_adjustment(params, [[], []], V, "cpu") is None
    md = build_sampling_metadata(params, [None, None], [[1], [2]], [[], []], V, "cpu")
    assert md.logits_adjustment is None


def adjusted_reference(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]]) -> torch.Tensor:
    """Row by row, in plain Python: allowed ids, bad-word bans, then the bias."""
    out = logits.clone()
    for i, p in enumerate(params):
        if p.allowed_token_ids:
            keep = torch.full((V,), float("-inf"))
            keep[p.allowed_token_ids] = out[i, p.allowed_token_ids]
            out[i] = keep
        for t in bad_word_bans(p._bad_words_token_ids, outputs[i]):
            out[i, t] = float("-inf")
        for t, b in (p.logit_bias or {}).items():
            out[i, t] += b
    return out


def test_greedy_rows_take_the_argmax_of_the_adjusted_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g)
    params = [
        SamplingParams(temperature=0.0, logit_bias={3: 50.0, 4: -2.0}),
        SamplingParams(temperature=0.0, allowed_token_ids=[9, 10, 11]),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, _bad_words_token_ids=[[int(logits[3].argmax())], [6, 7]]),
    ]
    outputs = [[], [], [1], [6]]
    md = build_sampling_metadata(params, [None] * 4, [[0]] * 4, outputs, V, "cpu")
    assert md.logits_adjustment is not None and md.logits_adjustment.reads_outputs
    got = Sampler()(logits, md).sampled_token_ids
    assert got.tolist() == adjusted_reference(logits, params, outputs).argmax(dim=-1).tolist()
    assert got[0] == 3 and got[1] in (9, 10, 11) and got[2] == logits[2].argmax()
    adjusted = logits.clone()
    apply_logits_adjustment(adjusted, md.logits_adjustment)
    assert torch.equal(adjusted, adjusted_reference(logits, params, outputs))


def test_random_rows_sample_only_allowed_ids_and_keep_raw_logprobs():
    logits = torch.zeros(2, V)
    params = [
        SamplingParams(temperature=1.0, allowed_token_ids=[2, 30], logprobs=1),
        SamplingParams(temperature=1.0, _bad_words_token_ids=[[t] for t in range(V) if t != 17], logprobs=1),
    ]
    seen = set()
    for seed in range(20):
        gens = [torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 100)]
        md = build_sampling_metadata(params, gens, [[0], [0]], [[], []], V, "cpu")
        out = Sampler()(logits, md)
        a, b = out.sampled_token_ids.tolist()
        assert a in (2, 30) and b == 17
        seen.add(a)
        assert torch.allclose(out.logprobs[:, 0], torch.full((2,), -torch.log(torch.tensor(float(V)))))
    assert seen == {2, 30}


def test_rejection_sampler_bans_a_bad_word_formed_by_the_drafts():
    # target argmax: 7 after the outputs, then 8, then 9: drafts [7, 8] match it, but [7, 8] is a bad word
    logits = torch.zeros(3, V)
    for row, (best, second) in enumerate([(7, 1), (8, 2), (9, 3)]):
        logits[row, best], logits[row, second] = 5.0, 4.0
    plain = SamplingParams(temperature=0.0)
    banned = SamplingParams(temperature=0.0, _bad_words_token_ids=[[7, 8]])
    for params, want in ((plain, [7, 8, 9]), (banned, [7, 2])):
        md = build_spec_sampling_metadata([params], [None], [[0]], [[4]], [[7, 8]], V, "cpu")
        assert RejectionSampler()(logits, [[7, 8]], None, md).to_lists() == [want]
    # the bias lifts a token over the draft: the first draft is rejected for it
    biased = SamplingParams(temperature=0.0, logit_bias={5: 10.0})
    md = build_spec_sampling_metadata([biased], [None], [[0]], [[4]], [[7, 8]], V, "cpu")
    assert RejectionSampler()(logits, [[7, 8]], None, md).to_lists() == [[5]]
