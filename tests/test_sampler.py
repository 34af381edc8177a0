"""Tests for vlserve.worker.sampler (CPU)."""

from __future__ import annotations

import pytest
import torch

from vlserve.sampling_params import SamplingParams
from vlserve.worker.sampler import (
    Sampler,
    SamplerOutput,
    apply_penalties,
    apply_top_k_top_p,
    build_sampling_metadata,
    make_generator,
    prepare_logits,
)

DEV = "cpu"
TOY_LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])  # 5-token toy distribution
N_DRAWS = 20_000


def build(params, generators=None, prompts=None, outputs=None, vocab_size=5):
    B = len(params)
    return build_sampling_metadata(
        params,
        generators or [None] * B,
        prompts or [[] for _ in range(B)],
        outputs or [[] for _ in range(B)],
        vocab_size,
        DEV,
    )


def sample(logits, params, **kw) -> SamplerOutput:
    md = build(params, vocab_size=logits.shape[-1], **kw)
    return Sampler()(logits, md)


def freqs(tokens: torch.Tensor, V: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).double() / tokens.numel()


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p.double() - q.double()).abs().sum())


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


# ---------------------------------------------------------------- greedy


def test_all_greedy_is_argmax():
    logits = torch.randn(8, 50)
    params = [SamplingParams(temperature=0.0) for _ in range(8)]
    md = build(params, vocab_size=50)
    assert md.all_greedy and not md.all_random and md.no_penalties and md.max_num_logprobs is None
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_ranks is None


def test_all_greedy_bf16_logits_match_their_float32_argmax_ties_included():
    # the plain greedy path takes argmax in the logits' own dtype; widening to float32 must not change a pick
    logits = torch.randn(6, 64).to(torch.bfloat16)
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # a tie: the first index wins in both dtypes
    logits[1, :] = -torch.inf
    logits[1, 40] = 0.0
    out = sample(logits, [SamplingParams(temperature=0.0) for _ in range(6)])
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64 and out.sampled_token_ids[:2].tolist() == [5, 40]
    # asking for logprobs takes the float32 path, which picks the same tokens
    with_logprobs = sample(logits, [SamplingParams(temperature=0.0, logprobs=1) for _ in range(6)])
    assert torch.equal(with_logprobs.sampled_token_ids, out.sampled_token_ids) and with_logprobs.logprobs is not None


def test_top_k_1_equals_greedy():
    logits = torch.randn(16, 40)
    out = sample(logits, [SamplingParams(temperature=1.0, top_k=1) for _ in range(16)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_tiny_top_p_keeps_the_top_token():
    logits = torch.randn(32, 30)
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6) for _ in range(32)])
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_input_logits_not_modified():
    logits = torch.randn(4, 20)
    before = logits.clone()
    params = [
        SamplingParams(
            temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3, min_tokens=2, stop_token_ids=[1]
        ),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.0, logprobs=2),
    ]
    sample(logits, params, prompts=[[0, 2]] * 4, outputs=[[3]] * 4)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- seeds


def run_seeded_steps(seed, steps, batch_extra, position, logits_row):
    """Sample `steps` tokens for one seeded row placed at `position` among `batch_extra` unseeded rows."""
    g = make_generator(seed)
    B = batch_extra + 1
    toks = []
    for _ in range(steps):
        params = [SamplingParams(temperature=1.0) for _ in range(B)]
        params[position] = SamplingParams(temperature=0.9, seed=seed)
        gens = [None] * B
        gens[position] = g
        logits = torch.randn(B, logits_row.shape[0])  # other rows: arbitrary
        logits[position] = logits_row
        toks.append(int(sample(logits, params, generators=gens).sampled_token_ids[position]))
    return toks


def test_same_seed_same_tokens_whatever_the_batch():
    row = torch.zeros(100)  # uniform: maximal randomness
    alone = run_seeded_steps(7, 30, 0, 0, row)
    again = run_seeded_steps(7, 30, 0, 0, row)
    batched = run_seeded_steps(7, 30, 5, 3, row)
    batched2 = run_seeded_steps(7, 30, 12, 0, row)
    assert alone == again == batched == batched2
    assert len(set(alone)) > 5  # it really is random from step to step


def test_different_seeds_differ():
    row = torch.zeros(100)
    a = run_seeded_steps(1, 40, 0, 0, row)
    b = run_seeded_steps(2, 40, 0, 0, row)
    assert a != b
    assert sum(x == y for x, y in zip(a, b)) < 10


def test_seeded_greedy_row_does_not_advance_generator():
    g = make_generator(5)
    state = g.get_state().clone()
    logits = torch.randn(2, 10)
    out = sample(logits, [SamplingParams(temperature=0.0, seed=5), SamplingParams()], generators=[g, None])
    assert torch.equal(g.get_state(), state)
    assert int(out.sampled_token_ids[0]) == int(logits[0].argmax())


# ---------------------------------------------------------------- distributions


def empirical(params_kw, n=N_DRAWS, seeded=False):
    logits = TOY_LOGITS.expand(n, -1).contiguous()
    params = [SamplingParams(**params_kw) for _ in range(n)]
    gens = [make_generator(i) for i in range(n)] if seeded else None
    out = sample(logits, params, generators=gens)
    return freqs(out.sampled_token_ids, 5)


def test_frequencies_match_softmax_temperature():
    for T in (1.0, 0.7, 1.5):
        expected = torch.softmax(TOY_LOGITS / T, -1)
        assert tv(empirical({"temperature": T}), expected) < 0.02, T


def test_frequencies_seeded_rows():
    expected = torch.softmax(TOY_LOGITS / 0.8, -1)
    assert tv(empirical({"temperature": 0.8}, n=8000, seeded=True), expected) < 0.03


def test_frequencies_seeded_and_unseeded_rows_in_one_batch():
    n = 12_000
    logits = TOY_LOGITS.expand(n, -1).contiguous()
    params = [SamplingParams(temperature=0.8) for _ in range(n)]
    gens = [make_generator(i) if i % 2 else None for i in range(n)]
    toks = sample(logits, params, generators=gens).sampled_token_ids
    expected = torch.softmax(TOY_LOGITS / 0.8, -1)
    assert tv(freqs(toks[0::2], 5), expected) < 0.03  # unseeded half
    assert tv(freqs(toks[1::2], 5), expected) < 0.03  # seeded half


def test_frequencies_top_k():
    expected = torch.zeros(5)
    expected[:2] = torch.softmax(TOY_LOGITS[:2], -1)
    got = empirical({"temperature": 1.0, "top_k": 2})
    assert got[2:].sum() == 0
    assert tv(got, expected) < 0.02


def test_frequencies_top_p():
    p = torch.softmax(TOY_LOGITS, -1)  # ~[.57, .21, .13, .08, .03]
    # top_p=0.8: cumulative .57, .78, .91 -> smallest set reaching 0.8 is the top 3.
    expected = torch.zeros(5)
    expected[:3] = p[:3] / p[:3].sum()
    got = empirical({"temperature": 1.0, "top_p": 0.8})
    assert got[3:].sum() == 0
    assert tv(got, expected) < 0.02
    # top_p=0.5: the first token alone already has 0.57 >= 0.5.
    got = empirical({"temperature": 1.0, "top_p": 0.5}, n=2000)
    assert got[0] == 1.0


def test_frequencies_top_k_and_top_p_and_temperature():
    T = 2.0
    p = torch.softmax(TOY_LOGITS / T, -1)  # ~[.36, .22, .17, .13, .08]
    k_kept = p[:4] / p[:4].sum()  # top_k=4 -> renormalised [.41, .25, .19, .15]; top_p=.6 -> top 2 (.66)
    assert k_kept[0] < 0.6 <= k_kept[:2].sum()
    expected = torch.zeros(5)
    expected[:2] = p[:2] / p[:2].sum()
    got = empirical({"temperature": T, "top_k": 4, "top_p": 0.6})
    assert tv(got, expected) < 0.02


def test_frequencies_min_p():
    p = torch.softmax(TOY_LOGITS, -1)
    # min_p=0.2: keep tokens with p >= 0.2 * p_max (~0.114): tokens 0, 1, 2.
    keep = p >= 0.2 * p.max()
    assert keep.tolist() == [True, True, True, False, False]
    expected = torch.where(keep, p, torch.zeros(()))
    expected /= expected.sum()
    got = empirical({"temperature": 1.0, "min_p": 0.2})
    assert got[3:].sum() == 0
    assert tv(got, expected) < 0.02


def test_top_k_top_p_helper_per_row():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0]])
    k = torch.tensor([2, 4, 1])
    out = apply_top_k_top_p(logits, k, None)
    inf = float("-inf")
    assert out.tolist() == [[inf, 3.0, 2.0, inf], [1.0, 3.0, 2.0, 0.0], [inf, 3.0, inf, inf]]
    out = apply_top_k_top_p(logits, k, torch.tensor([1.0, 1.0, 1.0]))
    assert out.tolist() == [[inf, 3.0, 2.0, inf], [1.0, 3.0, 2.0, 0.0], [inf, 3.0, inf, inf]]
    # the largest enabled k known on the host (build_sampling_metadata's max_top_k): the same rows, no device read
    for hint in (2, 3):
        assert apply_top_k_top_p(logits, k, None, max_k=hint).tolist() == out.tolist()
    md = build_sampling_metadata(
        [SamplingParams(temperature=1.0, top_k=t) for t in (2, 0, 3)], [None] * 3, [[]] * 3, [[]] * 3, 4, "cpu"
    )
    assert md.max_top_k == 3 and md.top_k.tolist() == [2, 4, 3]


# ---------------------------------------------------------------- penalties

PEN_LOGITS = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 3.0]])
PROMPT = [[0, 1]]
OUTPUT = [[2, 2, 3]]


def penalized(**kw):
    md = build([SamplingParams(temperature=0.0, **kw)], prompts=PROMPT, outputs=OUTPUT, vocab_size=6)
    assert not md.no_penalties
    return apply_penalties(PEN_LOGITS.clone(), md)[0].tolist()


def test_repetition_penalty():
    # seen (prompt or output): 0, 1, 2, 3; positive divided, negative multiplied.
    assert penalized(repetition_penalty=2.0) == pytest.approx([1.0, -2.0, 0.25, -1.0, 1.0, 3.0])


def test_presence_penalty():
    # only output tokens (2, 3), once each regardless of count.
    assert penalized(presence_penalty=0.5) == pytest.approx([2.0, -1.0, 0.0, -1.0, 1.0, 3.0])


def test_frequency_penalty():
    # token 2 appeared twice, token 3 once.
    assert penalized(frequency_penalty=0.3) == pytest.approx([2.0, -1.0, -0.1, -0.8, 1.0, 3.0])


def test_all_penalties_combined():
    got = penalized(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.3)
    assert got == pytest.approx([1.0, -2.0, 0.25 - 0.5 - 0.6, -1.0 - 0.5 - 0.3, 1.0, 3.0])


def test_penalties_change_greedy_choice_and_spare_other_rows():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0], [3.0, 2.9, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5), SamplingParams(temperature=0.0)]
    out = sample(logits, params, prompts=[[0], [0]], outputs=[[], [0]])
    assert out.sampled_token_ids.tolist() == [1, 0]
    out = sample(logits, [SamplingParams(temperature=0.0, frequency_penalty=0.2)] * 2, outputs=[[0], [1]])
    assert out.sampled_token_ids.tolist() == [1, 0]


def test_no_penalty_tensors_when_unneeded():
    V = 32_000
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=i) if i % 2 else SamplingParams(temperature=0)
        for i in range(64)
    ]
    gens = [make_generator(i) if i % 2 else None for i in range(64)]
    prompts = [list(range(i, i + 2000)) for i in range(64)]
    outputs = [list(range(100)) for _ in range(64)]
    md = build_sampling_metadata(params, gens, prompts, outputs, V, DEV)
    assert md.no_penalties and md.prompt_mask is None and md.output_counts is None
    assert md.no_top_k and md.no_min_p and not md.no_top_p
    assert sorted(md.generators) == list(range(1, 64, 2))


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_bans_stop_tokens():
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 4.0]])  # EOS=3 best, stop id 4 next
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4], _eos_token_ids=(3,))
    assert sample(logits, [p], outputs=[[1, 1]]).sampled_token_ids.item() == 2
    assert sample(logits, [p], outputs=[[1, 1, 1]]).sampled_token_ids.item() == 3
    p_ign = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4], ignore_eos=True, _eos_token_ids=(3,))
    assert sample(logits, [p_ign], outputs=[[]]).sampled_token_ids.item() == 3  # EOS not a stop token
    # random rows never draw a banned token either
    logits = torch.zeros(2000, 5)
    out = sample(logits, [SamplingParams(min_tokens=1, stop_token_ids=[0, 1], _eos_token_ids=(2,))] * 2000)
    assert set(out.sampled_token_ids.tolist()) == {3, 4}


def test_prepare_logits_bans_penalizes_and_keeps_raw_logprobs():
    """The preamble the Sampler and the rejection sampler share: bans + penalties on a copy, raw logprobs."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 4.0]], dtype=torch.float16)
    p = SamplingParams(min_tokens=2, stop_token_ids=[4], repetition_penalty=2.0, logprobs=1, _eos_token_ids=(3,))
    md = build([p], prompts=[[2]], outputs=[[1]])
    out, raw = prepare_logits(logits, md)
    assert out.dtype == torch.float32 and logits[0, 3] == 5.0  # the caller's tensor is untouched
    assert out[0].tolist() == [0.0, 0.5, 1.0, float("-inf"), float("-inf")]
    torch.testing.assert_close(raw, torch.log_softmax(logits.float(), dim=-1))
    assert prepare_logits(logits, build([SamplingParams()]))[1] is None  # no logprobs asked


# ---------------------------------------------------------------- logprobs


def test_logprobs_sampled_topk_and_ranks():
    logits = torch.randn(64, 30)
    params = [SamplingParams(temperature=1.3, logprobs=4, repetition_penalty=1.2) for _ in range(64)]
    out = sample(logits, params, prompts=[[1, 2, 3]] * 64)
    ref = torch.log_softmax(logits, -1)  # raw: before penalties and temperature
    ids, lps = out.logprob_token_ids, out.logprobs
    assert ids.shape == (64, 5) and lps.shape == (64, 5) and ids.dtype == torch.int64
    assert torch.equal(ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(lps[:, 0], ref.gather(1, out.sampled_token_ids[:, None])[:, 0])
    top_lp, top_ids = ref.topk(4, -1)
    assert torch.equal(ids[:, 1:], top_ids)
    torch.testing.assert_close(lps[:, 1:], top_lp)
    assert bool((lps[:, 1:-1] >= lps[:, 2:]).all())  # sorted descending
    order = ref.argsort(-1, descending=True)
    expected_rank = (order == out.sampled_token_ids[:, None]).int().argmax(-1) + 1
    assert torch.equal(out.sampled_ranks, expected_rank.to(torch.int64))
    assert (out.sampled_ranks > 1).any()  # the test exercises non-top samples too


def test_logprobs_zero_and_greedy_rank_one():
    logits = torch.randn(3, 10)
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=0)] * 3)
    assert out.logprobs.shape == (3, 1)
    assert out.sampled_ranks.tolist() == [1, 1, 1]
    torch.testing.assert_close(out.logprobs[:, 0], torch.log_softmax(logits, -1).amax(-1))


# ---------------------------------------------------------------- mixed batch


def test_mixed_batch_rows_behave_as_in_isolation():
    V = 50
    torch.manual_seed(0)
    logits = torch.randn(6, V) * 2
    prompts = [[1, 2], [3, 4, 5], [int(logits[2].argmax()), 7], [8], [9, 9], [10]]
    outputs = [[], [11], [12, 12], [], [int(logits[4].argmax())], []]
    params = [
        SamplingParams(temperature=0.0),  # greedy
        SamplingParams(temperature=0.8, top_p=0.9, seed=42),  # seeded random
        SamplingParams(temperature=0.0, repetition_penalty=3.0, frequency_penalty=0.5),  # greedy + penalties
        SamplingParams(temperature=1.0, top_k=5, logprobs=3, seed=7),  # seeded + logprobs
        SamplingParams(temperature=0.7, min_p=0.1, presence_penalty=2.0, seed=3),  # seeded + penalties
        SamplingParams(temperature=1.0, logprobs=1),  # unseeded random + logprobs
    ]
    seeds = [p.seed for p in params]
    gens = [make_generator(s) if s is not None else None for s in seeds]
    md = build_sampling_metadata(params, gens, prompts, outputs, V, DEV)
    assert not md.all_greedy and not md.all_random and not md.no_penalties and md.max_num_logprobs == 3
    batched = Sampler()(logits, md)
    assert batched.logprobs.shape == (6, 4)

    ref = torch.log_softmax(logits, -1)
    for i, p in enumerate(params):
        g = make_generator(seeds[i]) if seeds[i] is not None else None
        alone = Sampler()(logits[i : i + 1], build_sampling_metadata([p], [g], [prompts[i]], [outputs[i]], V, DEV))
        tok = int(batched.sampled_token_ids[i])
        if p.is_greedy or p.seed is not None:
            assert tok == int(alone.sampled_token_ids[0]), i
        if p.logprobs is not None:
            k = p.logprobs + 1
            torch.testing.assert_close(batched.logprobs[i, 1:k], alone.logprobs[0, 1:k])
            assert torch.equal(batched.logprob_token_ids[i, 1:k], alone.logprob_token_ids[0, 1:k])
        assert float(batched.logprobs[i, 0]) == pytest.approx(float(ref[i, tok]), abs=1e-5)
    # penalized greedy row: the prompt's best token is penalised away
    assert int(batched.sampled_token_ids[2]) != int(logits[2].argmax())
    assert int(batched.sampled_token_ids[0]) == int(logits[0].argmax())
    # top_k=5 row stays inside its top 5
    assert int(batched.sampled_token_ids[3]) in logits[3].topk(5).indices.tolist()


def test_greedy_ids_equal_argmax_with_ties_nan_and_inf():
    from vlserve.worker.sampler import greedy_ids

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for trial in range(60):
            x = torch.randint(-3, 4, (7, 300), generator=g).to(dtype)  # many equal maxima: the first one wins
            if trial % 3 == 0:
                x[trial % 7, trial % 300] = float("nan")
            if trial % 5 == 0:
                x[1] = float("-inf")
            assert torch.equal(greedy_ids(x), x.argmax(dim=-1)), (dtype, trial)
        wide = torch.randn(300, 9, generator=g).to(dtype).t()  # a strided view
        assert torch.equal(greedy_ids(wide), wide.argmax(dim=-1))
