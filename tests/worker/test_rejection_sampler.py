"""RejectionSampler: greedy exactness, Leviathan distribution exactness, seeding, reference parity."""

import pytest
import torch

from vlserve.sampling_params import SamplingParams
from vlserve.worker.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    RejectionSampler,
    build_spec_sampling_metadata,
    compute_target_probs,
    rejection_sample_ref,
)
from vlserve.worker.sampler import Sampler, apply_min_p, apply_top_k_top_p, build_sampling_metadata, make_generator

DEV = "cpu"
RS = RejectionSampler()


def spec_md(params, drafts, vocab, generators=None, prompts=None, outputs=None):
    B = len(params)
    return build_spec_sampling_metadata(
        params,
        generators or [None] * B,
        prompts or [[] for _ in range(B)],
        outputs or [[] for _ in range(B)],
        drafts,
        vocab,
        DEV,
    )


def expected_p(logits_row, temperature=1.0, top_k=None, top_p=None, min_p=None):
    """Target distribution computed independently with the main sampler's building blocks."""
    x = logits_row.unsqueeze(0) / temperature
    if min_p is not None:
        x = apply_min_p(x, torch.tensor([min_p]))
    x = apply_top_k_top_p(
        x, None if top_k is None else torch.tensor([top_k]), None if top_p is None else torch.tensor([top_p])
    )
    return torch.softmax(x, -1)[0].double()


def tv(a, b):
    return 0.5 * float((a.double() - b.double()).abs().sum())


def freqs(tokens, V):
    return torch.bincount(tokens, minlength=V).double() / tokens.numel()


def chi_square(tokens, p):
    """Pearson statistic over p's support; tokens outside the support must never appear."""
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    assert float(counts[p == 0].sum()) == 0, "emitted a token the target cannot produce"
    e = tokens.numel() * p[p > 0]
    return float(((counts[p > 0] - e) ** 2 / e).sum())


CHI2_LIMIT = 35.0  # df <= 7 here; P(chi2_7 > 35) ~ 1e-5


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------- greedy


def test_greedy_prefix_correction_and_bonus():
    V = 10
    # request 0: argmaxes 3, 4, 5 | bonus 6; drafts [3, 4, 9] -> accept 2, correction 5
    # request 1: drafts [1, 2] all match -> bonus 7
    # request 2: no drafts -> argmax 8
    # request 3: first draft wrong -> only the correction
    am = [3, 4, 5, 6, 1, 2, 7, 8, 0, 2]
    logits = torch.randn(len(am), V)
    logits[torch.arange(len(am)), torch.tensor(am)] = 10.0
    drafts = [[3, 4, 9], [1, 2], [], [1]]
    md = spec_md([SamplingParams(temperature=0.0)] * 4, drafts, V)
    out = RS(logits, drafts, None, md)
    assert out.to_lists() == [[3, 4, 5], [1, 2, 7], [8], [0]]
    assert out.output_token_ids.tolist() == [[3, 4, 5, -1], [1, 2, 7, -1], [8, -1, -1, -1], [0, -1, -1, -1]]
    assert out.num_accepted == [2, 2, 0, 0]
    assert out.num_draft_tokens == [3, 2, 0, 1]
    assert rejection_sample_ref(logits, drafts, None, md).to_lists() == out.to_lists()
    # draft probabilities are irrelevant for greedy rows
    q = [torch.softmax(torch.randn(len(d), V), -1) for d in drafts]
    assert RS(logits, drafts, q, md).to_lists() == out.to_lists()


def test_greedy_matches_sequential_decoding_with_penalties_and_min_tokens():
    """Row j sees outputs + drafts[:j]: repetition penalty and min_tokens bans are exact per position."""
    V, eos = 12, 11
    torch.manual_seed(1)
    params = SamplingParams(
        temperature=0.0, repetition_penalty=3.0, frequency_penalty=0.5, min_tokens=3, _eos_token_ids=(eos,)
    )
    prompt, outputs = [1, 2], [5]  # min_tokens=3: the stop token is banned for the next 2 positions only
    k = 5
    logits = torch.randn(k + 1, V)
    logits[:, eos] += 2.5  # EOS would win without the ban
    logits[:, 4] += 2.0
    # sequential greedy decoding with the main sampler, one token at a time
    seq = []
    for j in range(k + 1):
        md1 = build_sampling_metadata([params], [None], [prompt], [outputs + seq], V, DEV)
        seq.append(int(Sampler()(logits[j : j + 1], md1).sampled_token_ids[0]))
    assert seq[0] != eos and seq[1] != eos and eos in seq[2:]  # the ban lifts exactly at position 2
    for m in range(k + 1):  # drafts correct up to position m
        drafts = seq[:k]
        if m < k:
            drafts = list(drafts)
            drafts[m] = (drafts[m] + 1) % V
        md = spec_md([params], [drafts], V, prompts=[prompt], outputs=[outputs])
        assert RS(logits, [drafts], None, md).to_lists() == [seq[: m + 1]], m
        assert rejection_sample_ref(logits, [drafts], None, md).to_lists() == [seq[: m + 1]]


# ---------------------------------------------------------------- random rows: exactness


def test_q_equal_p_accepts_everything():
    V, B, k = 16, 400, 4
    params = [SamplingParams(temperature=0.8, top_k=10, top_p=0.9)] * B
    logits = torch.randn(B * (k + 1), V)
    drafts0 = [[0] * k for _ in range(B)]
    md = spec_md(params, drafts0, V)
    p = compute_target_probs(logits, md)  # exactly the target's processed distribution
    p_draft = p.view(B, k + 1, V)[:, :k]
    drafts = torch.multinomial(p_draft.reshape(-1, V), 1).view(B, k).tolist()
    q = [p_draft[i] for i in range(B)]
    out = RS(logits, drafts, q, md)
    assert out.num_accepted == [k] * B
    # one flat [num_draft_tokens, V] tensor works too
    assert RS(logits, drafts, p_draft.reshape(-1, V), md).num_accepted == [k] * B


def test_draft_outside_top_k_is_always_rejected():
    V, B = 8, 300
    logits = torch.arange(V, dtype=torch.float32).repeat(2 * B, 1)  # token 0 is least likely
    params = [SamplingParams(temperature=1.0, top_k=3)] * B
    drafts = [[0]] * B
    out = RS(logits, drafts, None, spec_md(params, drafts, V))
    toks = out.output_token_ids[:, 0]
    assert out.num_accepted == [0] * B and bool((toks >= V - 3).all())


def _check_convergence(V, params_kw, q_full: bool, adversarial: bool, n=20000, k=2, seed=0):
    """Every row holds the same target logits, so each emitted token must be distributed as p."""
    g = torch.Generator().manual_seed(seed)
    row = torch.randn(V, generator=g) * 1.5
    p = expected_p(row, **params_kw)
    # an arbitrary draft distribution q: either unrelated to p, or deliberately unlike it (favouring p's
    # unlikely and masked tokens -> almost every draft is rejected)
    q = torch.softmax((-row if adversarial else 0.0) + torch.randn(V, generator=g), -1)
    drafts_t = torch.multinomial(q, n * k, replacement=True, generator=g).view(n, k)
    drafts = drafts_t.tolist()
    md = spec_md([SamplingParams(**params_kw)] * n, drafts, V)
    logits = row.repeat(n * (k + 1), 1)
    out = RS(logits, drafts, q.expand(n * k, V) if q_full else None, md)
    toks = out.output_token_ids
    first = toks[:, 0]
    has2 = toks[:, 1] >= 0  # the second emitted token exists iff draft 0 was accepted
    # acceptance rate at position 0: sum_v q(v) min(1, p(v)/q(v)) = sum_v min(p, q)  (one-hot: sum_v q(v) p(v))
    acc_rate = float(has2.double().mean())
    theory = float(torch.minimum(p, q.double()).sum()) if q_full else float((p * q.double()).sum())
    return first, toks[has2, 1], acc_rate, theory, p


@pytest.mark.parametrize("q_full", [False, True], ids=["one_hot_q", "full_q"])
@pytest.mark.parametrize("adversarial", [False, True], ids=["random_q", "adversarial_q"])
@pytest.mark.parametrize(
    "params_kw",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=6, top_p=0.9),
        dict(temperature=1.3, min_p=0.05),
    ],
    ids=["plain", "temp_topk_topp", "temp_minp"],
)
def test_emitted_tokens_follow_target_distribution(params_kw, adversarial, q_full):
    first, second, acc, theory, p = _check_convergence(8, params_kw, q_full, adversarial)
    assert tv(freqs(first, 8), p) < 0.02, (freqs(first, 8), p)
    assert chi_square(first, p) < CHI2_LIMIT
    assert abs(acc - theory) < 0.02, (acc, theory)
    # the token after an accepted draft is again exactly p (few samples when q is adversarial)
    assert chi_square(second, p) < CHI2_LIMIT, (second.numel(), freqs(second, 8), p)
    if second.numel() >= 4000:
        assert tv(freqs(second, 8), p) < 0.03


# ---------------------------------------------------------------- seeding and parity


def _mixed_batch(V=20, seed=3, full_q=True):
    g = torch.Generator().manual_seed(seed)
    drafts = [[1, 2, 3], [], [4, 5], [6], [7, 8, 9, 10], [2, 2]]
    params = [
        SamplingParams(temperature=0.9, seed=11),
        SamplingParams(temperature=0.7, seed=12),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.8, seed=13),
        SamplingParams(temperature=1.1, top_k=5, repetition_penalty=1.3),
        SamplingParams(temperature=0.6, min_p=0.1, logprobs=2),
    ]
    T = sum(len(d) + 1 for d in drafts)
    logits = torch.randn(T, V, generator=g)
    # make drafts plausible so both acceptances and rejections happen
    for i, d in enumerate(drafts):
        base = sum(len(x) + 1 for x in drafts[:i])
        for j, t in enumerate(d):
            logits[base + j, t] += 2.0
    q = (
        [
            None if (i % 2 or not d) else torch.softmax(torch.randn(len(d), V, generator=g), -1)
            for i, d in enumerate(drafts)
        ]
        if full_q
        else None
    )
    return logits, drafts, params, q


def _gens(params):
    return [make_generator(p.seed) if p.seed is not None else None for p in params]


def test_fast_path_matches_reference():
    for seed in range(6):
        for full_q in (False, True):
            logits, drafts, params, q = _mixed_batch(seed=seed, full_q=full_q)
            V = logits.shape[1]
            md = spec_md(
                params,
                drafts,
                V,
                generators=_gens(params),
                prompts=[[1, 2, 3]] * len(params),
                outputs=[[4]] * len(params),
            )
            torch.manual_seed(seed)
            fast = RS(logits, drafts, q, md)
            md = spec_md(
                params,
                drafts,
                V,
                generators=_gens(params),
                prompts=[[1, 2, 3]] * len(params),
                outputs=[[4]] * len(params),
            )
            torch.manual_seed(seed)
            ref = rejection_sample_ref(logits, drafts, q, md)
            assert fast.to_lists() == ref.to_lists()
            assert torch.equal(fast.logprob_token_ids, ref.logprob_token_ids)


def test_seeded_requests_are_deterministic_and_batch_independent():
    logits, drafts, params, q = _mixed_batch()
    V = logits.shape[1]
    seeded = [i for i, p in enumerate(params) if p.seed is not None]
    runs = []
    for trial in range(3):
        torch.manual_seed(100 + trial)  # the global RNG differs; seeded rows must not care
        md = spec_md(params, drafts, V, generators=_gens(params))
        out = RS(logits, drafts, q, md).to_lists()
        runs.append([out[i] for i in seeded])
    assert runs[0] == runs[1] == runs[2]
    # the same seeded request alone gives the same result
    cu = [0]
    for d in drafts:
        cu.append(cu[-1] + len(d) + 1)
    for n, i in enumerate(seeded):
        md = spec_md([params[i]], [drafts[i]], V, generators=_gens([params[i]]))
        alone = RS(logits[cu[i] : cu[i + 1]], [drafts[i]], None if q is None else [q[i]], md).to_lists()[0]
        assert alone == runs[0][n]
    # and the generator advances from step to step
    g = make_generator(5)
    p5 = SamplingParams(temperature=1.0, seed=5)
    row = torch.zeros(1, 1000)
    a = RS(row, [[]], None, spec_md([p5], [[]], 1000, generators=[g])).to_lists()
    b = RS(row, [[]], None, spec_md([p5], [[]], 1000, generators=[g])).to_lists()
    assert a != b


def test_no_drafts_equals_main_sampler():
    """k = 0 everywhere: the rejection sampler is the main sampler (seeded rows draw the same noise)."""
    V, B = 50, 6
    params = [SamplingParams(temperature=0.8, seed=i, top_k=20, top_p=0.95) for i in range(B - 1)]
    params.append(SamplingParams(temperature=0.0))
    gens_main, gens_spec = _gens(params), _gens(params)  # persistent per-request generators, one set each
    for _ in range(4):
        logits = torch.randn(B, V)
        md_main = build_sampling_metadata(params, gens_main, [[]] * B, [[]] * B, V, DEV)
        md_spec = spec_md(params, [[]] * B, V, generators=gens_spec)
        main = Sampler()(logits, md_main).sampled_token_ids.tolist()
        assert RS(logits, [[]] * B, None, md_spec).to_lists() == [[t] for t in main]


def test_logprobs_are_per_row_of_the_emitted_tokens():
    logits, drafts, params, q = _mixed_batch()
    V = logits.shape[1]
    md = spec_md(params, drafts, V, generators=_gens(params))
    out = RS(logits, drafts, q, md)
    raw = torch.log_softmax(logits, -1)
    cu = 0
    for i, toks in enumerate(out.to_lists()):
        for j, t in enumerate(toks):
            r = cu + j
            assert int(out.logprob_token_ids[r, 0]) == t
            assert torch.allclose(out.logprobs[r, 0], raw[r, t])
            assert int(out.sampled_ranks[r]) == int((raw[r] > raw[r, t]).sum()) + 1
            assert out.logprob_token_ids[r, 1:].tolist() == raw[r].topk(2).indices.tolist()
        cu += len(drafts[i]) + 1


def test_layout_errors():
    md = spec_md([SamplingParams(temperature=0.0)], [[1, 2]], 8)
    with pytest.raises(ValueError, match="rows"):
        RS(torch.randn(2, 8), [[1, 2]], None, md)
    with pytest.raises(ValueError, match="draft_probs"):
        RS(torch.randn(3, 8), [[1, 2]], [torch.rand(1, 8)], md)
    assert PLACEHOLDER_TOKEN_ID == -1
