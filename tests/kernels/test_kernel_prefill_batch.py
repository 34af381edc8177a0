"""Batched causal prefill (`prefill_batch`) against the per-sequence torch path and a plain loop."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from _kernel_testutils import build_metadata, kernel_tol, make_paged_kv, naive_attention, poison_unused_slots

from vlserve.kernels import attention_ref, prefill_batch
from vlserve.kernels.attention_ref import _prefill_from_lists, attention_forward_ref
from vlserve.kernels.kv_quant import dequantize_kv, quantize_kv
from vlserve.kernels.prefill_batch import batchable_prefills, plan_prefill_groups


def _random_seqs(num_seqs, rng, block_size):
    """(cached_prefix, q_len) per sequence: fresh prompts, prefix hits, chunks ending mid-block, single tokens."""
    seqs = []
    for _ in range(num_seqs):
        kind = rng.randrange(4)
        if kind == 0:
            seqs.append((0, rng.randint(1, 40)))  # fresh prompt
        elif kind == 1:
            seqs.append((rng.choice([block_size, 2 * block_size]), rng.randint(1, 30)))  # prefix-cache hit
        elif kind == 2:
            seqs.append((rng.randint(1, 50), rng.randint(1, 20)))  # chunked prefill
        else:
            seqs.append((rng.randint(0, 20), 1))
    return seqs


def _case(seqs, ratio, dtype, block_size=16, num_kv_heads=2, head_dim=64, seed=0):
    """Paged caches whose every unused slot is NaN, block-table padding pointing at a never-written (NaN) block."""
    g = torch.Generator().manual_seed(seed)
    contexts = [
        tuple(torch.randn(p + q, num_kv_heads, head_dim, generator=g).to(dtype) for _ in range(2)) for p, q in seqs
    ]
    k_cache, v_cache, tables = make_paged_kv(contexts, block_size, generator=g)
    seq_lens = [p + q for p, q in seqs]
    used = {int(tables[b, i]) for b, n in enumerate(seq_lens) for i in range(-(-n // block_size))}
    free_block = min(set(range(k_cache.shape[0])) - used)
    for b, n in enumerate(seq_lens):
        tables[b, -(-n // block_size) :] = free_block
    poison_unused_slots(k_cache, v_cache, tables, seq_lens)
    qsl = [0] + list(itertools.accumulate(q for _, q in seqs))
    query = torch.randn(qsl[-1], num_kv_heads * ratio, head_dim, generator=g).to(dtype)
    return query, contexts, k_cache, v_cache, tables, qsl, seq_lens


def _count_plans(monkeypatch, calls):
    """Record the sequences of every `plan_prefill_groups` call, from either module that makes one."""
    real = prefill_batch.plan_prefill_groups
    for module in (attention_ref, prefill_batch):
        monkeypatch.setattr(module, "plan_prefill_groups", lambda *a: calls.append(a[3]) or real(*a))


def _run(query, k_cache, v_cache, tables, qsl, lens, batch, **kw):
    out = torch.full_like(query, float("nan"))  # every real row must be written
    return _prefill_from_lists(query, k_cache, v_cache, tables, qsl, lens, 0.125, out, batch=batch, **kw)


@pytest.mark.parametrize("num_seqs", [1, 2, 7, 33, 100])
@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_prefill_matches_per_sequence(num_seqs, ratio, dtype):
    block_size = 16
    seqs = _random_seqs(num_seqs, random.Random(num_seqs * 10 + ratio), block_size)
    query, _, k_cache, v_cache, tables, qsl, lens = _case(seqs, ratio, dtype, block_size, seed=num_seqs)
    batched = _run(query, k_cache, v_cache, tables, qsl, lens, batch=True)
    per_seq = _run(query, k_cache, v_cache, tables, qsl, lens, batch=False)
    assert not batched.isnan().any()
    torch.testing.assert_close(batched.float(), per_seq.float(), **kernel_tol("cpu", dtype))


def test_batched_prefill_matches_naive():
    seqs = [(0, 9), (19, 6), (16, 1), (3, 14), (0, 1), (32, 17), (5, 5)]
    query, contexts, k_cache, v_cache, tables, qsl, lens = _case(seqs, 2, torch.float32, seed=3)
    out = _run(query, k_cache, v_cache, tables, qsl, lens, batch=True)
    for b, (k, v) in enumerate(contexts):
        first = lens[b] - (qsl[b + 1] - qsl[b])
        want = naive_attention(query[qsl[b] : qsl[b + 1]], k, v, list(range(first, lens[b])), 0.125)
        torch.testing.assert_close(out[qsl[b] : qsl[b + 1]], want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_fresh_prompts_match_per_sequence(dtype):
    rng = random.Random(8)
    seqs = [(0, rng.randint(60, 100)) for _ in range(70)]  # the pooling runner's chat prompts: no cached prefix
    query, _, k_cache, v_cache, tables, qsl, lens = _case(seqs, 4, dtype, seed=8)
    batched = _run(query, k_cache, v_cache, tables, qsl, lens, batch=True)
    assert not batched.isnan().any()
    per_seq = _run(query, k_cache, v_cache, tables, qsl, lens, batch=False)
    torch.testing.assert_close(batched.float(), per_seq.float(), **kernel_tol("cpu", dtype))


def test_batched_prefill_skips_empty_sequences_and_keeps_other_rows():
    seqs = [(4, 0), (0, 7), (20, 0), (9, 3)]
    query, _, k_cache, v_cache, tables, qsl, lens = _case(seqs, 2, torch.float32, seed=4)
    assert batchable_prefills(qsl, lens) == [1, 3]
    out = _run(query, k_cache, v_cache, tables, qsl, lens, batch=True)
    torch.testing.assert_close(out, _run(query, k_cache, v_cache, tables, qsl, lens, batch=False), atol=2e-5, rtol=1e-5)


def test_batched_prefill_fp8_cache():
    seqs = _random_seqs(24, random.Random(5), 16)
    query, _, k_cache, v_cache, tables, qsl, lens = _case(seqs, 4, torch.float32, seed=5)
    k8, v8 = quantize_kv(k_cache, 0.011), quantize_kv(v_cache, 0.0093)  # NaN slots stay NaN bytes
    kw = dict(k_scale=0.011, v_scale=0.0093)
    batched = _run(query, k8, v8, tables, qsl, lens, batch=True, **kw)
    per_seq = _run(query, k8, v8, tables, qsl, lens, batch=False, **kw)
    assert not batched.isnan().any()
    torch.testing.assert_close(batched, per_seq, atol=2e-5, rtol=1e-5)
    kd, vd = dequantize_kv(k8, 0.011, torch.float32), dequantize_kv(v8, 0.0093, torch.float32)
    torch.testing.assert_close(batched, _run(query, kd, vd, tables, qsl, lens, batch=False), atol=2e-5, rtol=1e-5)


def test_sliding_window_and_bidirectional_sequences_stay_per_sequence(monkeypatch):
    seqs = [(0, 9), (19, 6), (3, 14)]
    query, _, k_cache, v_cache, tables, qsl, lens = _case(seqs, 2, torch.float32, seed=6)
    assert batchable_prefills(qsl, lens, (False, True, False)) == [0, 2]
    assert batchable_prefills(qsl, lens, (False, True, True)) == []  # one causal sequence: nothing to batch
    planned = []
    _count_plans(monkeypatch, planned)
    out = _run(query, k_cache, v_cache, tables, qsl, lens, batch=True, sliding_window=8)
    assert planned == []
    want = _run(query, k_cache, v_cache, tables, qsl, lens, batch=False, sliding_window=8)
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_groups_bound_padding_and_size():
    rng = random.Random(7)
    seqs = [(rng.choice([0, rng.randint(1, 60)]), rng.randint(1, 120)) for _ in range(300)]  # half fresh prompts
    qsl = [0] + list(itertools.accumulate(q for _, q in seqs))
    lens = [p + q for p, q in seqs]
    tables = torch.zeros(len(seqs), 12, dtype=torch.int32)
    groups = plan_prefill_groups(tables, qsl, lens, list(range(len(seqs))), 16)
    rows = torch.cat([g.out_rows for g in groups])
    assert sorted(rows.tolist()) == list(range(qsl[-1]))  # every query row exactly once
    assert {g.mask is None for g in groups} == {True, False}
    for g in groups:
        assert g.num_seqs <= prefill_batch.MAX_GROUP_SEQS
        members = [b for b in range(len(seqs)) if qsl[b] in set(g.out_rows.tolist())]
        fresh = [seqs[b][0] == 0 for b in members]
        assert all(fresh) or not any(fresh)  # fresh prompts are grouped apart
        if all(fresh):  # SDPA's own causal mask over the group's longest prompt
            assert g.mask is None and g.key_len == g.query_len == max(lens[b] for b in members)
        else:
            assert g.mask.shape == (g.num_seqs, 1, g.query_len, g.num_blocks * 16) and g.key_len == g.num_blocks * 16
        if g.num_seqs > 1:
            real = sum((qsl[b + 1] - qsl[b]) * lens[b] for b in range(len(seqs)) if qsl[b] in set(g.out_rows.tolist()))
            longest = max(lens[b] for b in range(len(seqs)) if qsl[b] in set(g.out_rows.tolist()))
            assert g.num_seqs * g.query_len * longest <= prefill_batch.PAD_AREA_LIMIT * real
            assert g.num_seqs * g.query_len * longest <= prefill_batch.MAX_GROUP_SCORES
            assert g.num_seqs * longest <= prefill_batch.MAX_GROUP_KEYS


def test_large_sequences_are_not_batched():
    qsl, lens = [0, 300, 340], [400, 70]  # 300 x 400 query-key pairs; 40 x 70
    assert prefill_batch.MAX_SEQ_SCORES < 300 * 400
    assert batchable_prefills(qsl, lens) == []  # one small sequence left: nothing to batch
    assert batchable_prefills(qsl + [341], lens + [5000]) == [1, 2]  # one query over a long context is small


def test_attention_forward_plans_groups_once_per_step(monkeypatch):
    seqs = [(0, 12), (20, 7), (16, 40), (5, 2)]  # a chunk over MAX_KERNEL_QUERY_LEN: the torch prefill runs
    contexts = [tuple(torch.randn(p + q, 2, 64) for _ in range(2)) for p, q in seqs]
    k_cache, v_cache, tables = make_paged_kv(contexts, 16)
    q_lens, lens = [q for _, q in seqs], [p + q for p, q in seqs]
    md = build_metadata(q_lens, lens, tables, 16, num_decodes=0, num_padding_tokens=2)
    key = torch.cat([k[p:] for (k, _), (p, _) in zip(contexts, seqs)] + [torch.randn(2, 2, 64)])
    value = torch.cat([v[p:] for (_, v), (p, _) in zip(contexts, seqs)] + [torch.randn(2, 2, 64)])
    query = torch.randn(key.shape[0], 8, 64)
    calls = []
    _count_plans(monkeypatch, calls)
    outs = [attention_forward_ref(query, key, value, k_cache, v_cache, md, 0.125) for _ in range(3)]  # 3 "layers"
    assert len(calls) == 1
    qsl = md.query_start_loc_cpu
    for b, (k, v) in enumerate(contexts):
        want = naive_attention(query[qsl[b] : qsl[b + 1]], k, v, list(range(lens[b] - q_lens[b], lens[b])), 0.125)
        torch.testing.assert_close(outs[-1][qsl[b] : qsl[b + 1]], want, atol=2e-5, rtol=1e-5)
    assert torch.equal(outs[0], outs[2]) and not outs[0][qsl[-1] :].any()
