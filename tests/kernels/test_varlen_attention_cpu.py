"""The C++ segment attention (vlserve/kernels/varlen_attention_cpu.py) against a float64 reference, and its two
callers: `varlen_attention(..., causal=...)` and a step of fresh prompts through `attention_forward`."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tests.kernels._kernel_testutils import build_metadata, poison_unused_slots
from vlserve.kernels import attention_forward, varlen_attention
from vlserve.kernels.varlen_attention_cpu import (
    DISABLE_ENV,
    bf16_pair_engine,
    max_segment_len,
    segment_attention_cpu,
    segment_kernel_takes,
    varlen_attention_cpu_kernel,
)

pytestmark = pytest.mark.skipif(varlen_attention_cpu_kernel() is None, reason="no C++ toolchain for CPU kernels")


def reference(q, k, v, starts, lens, scale, causal):
    """float64 attention of each segment over itself, [T, Hq, D] in q's dtype; rows outside segments zero."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for start, n in zip(starts, lens):
        for h in range(q.shape[1]):
            qs, ks, vs = (t[start : start + n, hh].double() for t, hh in ((q, h), (k, h // group), (v, h // group)))
            scores = qs @ ks.T * scale  # [n, n]
            if causal:
                scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            out[start : start + n, h] = torch.softmax(scores, dim=-1) @ vs
    return out


def qkv_views(num_tokens, hq, hkv, d, dtype, seed):
    """q, k, v as column views of one fused [T, (Hq + 2 Hkv) * D] projection (row stride > the heads' width)."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q = fused[:, : hq * d].view(num_tokens, hq, d)
    k = fused[:, hq * d : (hq + hkv) * d].view(num_tokens, hkv, d)
    v = fused[:, (hq + hkv) * d :].view(num_tokens, hkv, d)
    return q, k, v


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (12, 12, 64), (4, 4, 80), (2, 1, 128), (3, 3, 20)])
def test_kernel_matches_reference(dtype, tol, causal, hq, hkv, d):
    rng = random.Random(hq * 100 + d + causal)
    lens = [rng.randint(1, 70) for _ in range(6)] + [1, 17]
    starts = [sum(lens[:i]) + 3 * i for i in range(len(lens))]  # gaps between segments stay untouched
    num_tokens = starts[-1] + lens[-1] + 2
    q, k, v = qkv_views(num_tokens, hq, hkv, d, dtype, seed=len(lens) + d)
    out = torch.full((num_tokens, hq, d), 7.0, dtype=dtype)
    with torch.no_grad():
        assert segment_kernel_takes(q, k, v, out)
        segment_attention_cpu(q, k, v, starts, lens, d**-0.5, causal, out)
    want = reference(q, k, v, starts, lens, d**-0.5, causal)
    inside = torch.zeros(num_tokens, dtype=torch.bool)
    for s, n in zip(starts, lens):
        inside[s : s + n] = True
    assert (out[inside].double() - want[inside]).abs().max().item() < tol
    assert bool((out[~inside] == 7.0).all())  # rows outside every segment are not written


@pytest.mark.parametrize("head_dim", [64, 80, 72])
@pytest.mark.parametrize("causal", [True, False])
def test_bf16_segments_up_to_the_pair_limit(causal, head_dim):
    # where bf16 heads multiply as bf16 pairs (AMX tiles or vdpbf16ps; heads of 80 and 72 zero-padded to 96),
    # segments past the widened path's limit go through the kernel (several 32-row blocks and key panels, GQA; short
    # ones too) and match the float64 reference; elsewhere the limit is the widened path's
    if not bf16_pair_engine():
        assert max_segment_len(causal, torch.bfloat16, head_dim) == max_segment_len(causal, torch.bfloat16)
        pytest.skip("no bf16 pair products (AMX-BF16 or AVX512-BF16) in the kernel built here")
    limit = max_segment_len(causal, torch.bfloat16, head_dim)
    assert limit > max_segment_len(causal, torch.bfloat16)
    longest = min(limit, 608)  # the float64 reference holds [L, L] scores per head
    lens = [longest, 1, 33, longest - 31, 64, 7, 12]
    starts = [sum(lens[:i]) + 2 * i for i in range(len(lens))]
    num_tokens = starts[-1] + lens[-1] + 1
    q, k, v = qkv_views(num_tokens, 8, 2, head_dim, torch.bfloat16, seed=9)
    out = torch.full((num_tokens, 8, head_dim), 7.0, dtype=torch.bfloat16)
    with torch.no_grad():
        segment_attention_cpu(q, k, v, starts, lens, head_dim**-0.5, causal, out)
    want = reference(q, k, v, starts, lens, head_dim**-0.5, causal)
    inside = torch.zeros(num_tokens, dtype=torch.bool)
    for s, n in zip(starts, lens):
        inside[s : s + n] = True
    assert (out[inside].double() - want[inside]).abs().max().item() < 2e-2
    assert bool((out[~inside] == 7.0).all())


@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("causal", [True, False])
def test_bf16_pairs_are_as_close_to_float64_as_sdpa(causal, head_dim):
    # the pairs' flash softmax (a polynomial exp2, bf16 weights) errs no more than torch's bf16 SDPA on the same
    # segments: a mean error within 10% of SDPA's (a weight off by 1% would double it)
    if not bf16_pair_engine():
        pytest.skip("no bf16 pair products (AMX-BF16 or AVX512-BF16) in the kernel built here")
    lens, starts = [300, 33, 130], [0, 300, 333]
    q, k, v = qkv_views(463, 8, 2, head_dim, torch.bfloat16, seed=3)
    out = torch.empty(463, 8, head_dim, dtype=torch.bfloat16)
    sdpa = torch.empty_like(out)
    with torch.no_grad():
        segment_attention_cpu(q, k, v, starts, lens, head_dim**-0.5, causal, out)
        for s, n in zip(starts, lens):
            qs, ks, vs = (t[s : s + n].repeat_interleave(8 // t.shape[1], 1).transpose(0, 1) for t in (q, k, v))
            sdpa[s : s + n] = F.scaled_dot_product_attention(
                qs.contiguous(), ks.contiguous(), vs.contiguous(), is_causal=causal, scale=head_dim**-0.5
            ).transpose(0, 1)
    want = reference(q, k, v, starts, lens, head_dim**-0.5, causal)
    kernel_error = (out.double() - want).abs().mean().item()
    sdpa_error = (sdpa.double() - want).abs().mean().item()
    assert kernel_error < 1.1 * sdpa_error, (kernel_error, sdpa_error)


def test_segment_outside_rows_is_a_value_error():
    q, k, v = qkv_views(10, 2, 2, 16, torch.float32, seed=0)
    out = torch.empty(10, 2, 16)
    with torch.no_grad(), pytest.raises(ValueError, match="within the rows"):
        segment_attention_cpu(q, k, v, [4], [7], 0.25, True, out)


def test_not_taken_with_grad_or_when_disabled(monkeypatch):
    q, k, v = qkv_views(8, 2, 2, 16, torch.float32, seed=1)
    out = torch.empty(8, 2, 16)
    assert not segment_kernel_takes(q, k, v, out)  # autograd on
    with torch.no_grad():
        assert segment_kernel_takes(q, k, v, out)
        monkeypatch.setenv(DISABLE_ENV, "0")
        assert not segment_kernel_takes(q, k, v, out)


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_attention_mixes_kernel_and_sdpa_segments(causal):
    # segments on both sides of the kernel's length limit: the long ones go through SDPA, same answer
    limit = max_segment_len(causal, torch.float32)
    lens = [5, limit, limit + 1, 33, limit + 40]
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    q, k, v = qkv_views(bounds[-1], 4, 2, 32, torch.float32, seed=2)
    with torch.no_grad():
        got = varlen_attention(q, k, v, torch.tensor(bounds, dtype=torch.int32), 32**-0.5, causal=causal)
    want = reference(q, k, v, bounds[:-1], lens, 32**-0.5, causal)
    assert (got.double() - want).abs().max().item() < 2e-5


@pytest.mark.parametrize("num_decodes", [0, 2])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("prefix", [False, True])
def test_short_prefill_chunks_attend_their_cached_context(num_decodes, dtype, tol, prefix, monkeypatch):
    # a step of short prefill chunks (fresh prompts, or with a cached prefix; after some decodes) goes through one
    # paged segment call and matches the reference over the cached context; unused cache slots hold NaN, so a read
    # past a sequence would show
    import vlserve.kernels.attention_ref as attention_ref

    calls = []
    kernel = attention_ref.paged_segments_cpu
    monkeypatch.setattr(attention_ref, "paged_segments_cpu", lambda *a: calls.append(a[4]) or kernel(*a))
    torch.manual_seed(3)
    hq, hkv, d, block_size = 4, 2, 32, 16
    q_lens = [1] * num_decodes + [9, 40, 23]
    seq_lens = [20, 35][:num_decodes] + ([30, 40, 61] if prefix else [9, 40, 23])
    blocks_per_seq = 4
    tables = torch.arange(1, 1 + len(q_lens) * blocks_per_seq, dtype=torch.int32).view(len(q_lens), blocks_per_seq)
    k_cache = torch.randn(1 + tables.numel(), block_size, hkv, d).to(dtype)
    v_cache = torch.randn_like(k_cache)
    poison_unused_slots(k_cache, v_cache, tables, [s - q for s, q in zip(seq_lens, q_lens)])
    md = build_metadata(q_lens, seq_lens, tables, block_size, num_decodes)
    num_tokens = sum(q_lens)
    q, k, v = qkv_views(num_tokens, hq, hkv, d, dtype, seed=4)
    with torch.no_grad():
        got = attention_forward(q, k, v, k_cache, v_cache, md, d**-0.5)
    assert calls == [list(range(num_decodes, num_decodes + 3))]  # the prefill sequences, in one call
    row, group = 0, hq // hkv
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        positions = torch.arange(seq_len)
        slots = tables[b, positions // block_size].long() * block_size + positions % block_size
        keys = k_cache.view(-1, hkv, d)[slots]  # [S, Hkv, D]: the prefix and this step's rows, now written
        values = v_cache.view(-1, hkv, d)[slots]
        for i in range(q_len):
            pos = seq_len - q_len + i
            for h in range(hq):
                scores = keys[: pos + 1, h // group].double() @ q[row + i, h].double() * d**-0.5  # [pos + 1]
                want = torch.softmax(scores, dim=0) @ values[: pos + 1, h // group].double()  # [D]
                assert (got[row + i, h].double() - want).abs().max().item() < tol, (b, i, h)
        row += q_len


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_long_prefill_chunks_take_the_kernel_within_its_limits(dtype, tol, monkeypatch):
    # a chunk of 250 rows over 300 positions goes through the paged segment call where `paged_segment_limits` takes
    # it (the AVX-512 CPU without AMX), else through the torch prefill; either way it matches the float64 reference
    import vlserve.kernels.attention_ref as attention_ref
    from vlserve.kernels.varlen_attention_cpu import paged_segment_limits

    calls = []
    kernel = attention_ref.paged_segments_cpu
    monkeypatch.setattr(attention_ref, "paged_segments_cpu", lambda *a: calls.append(a[4]) or kernel(*a))
    torch.manual_seed(6)
    hq, hkv, d, block_size, q_len, seq_len = 4, 2, 64, 16, 250, 300
    tables = torch.arange(1, 20, dtype=torch.int32).view(1, 19)
    k_cache = torch.randn(20, block_size, hkv, d).to(dtype)
    v_cache = torch.randn_like(k_cache)
    poison_unused_slots(k_cache, v_cache, tables, [seq_len - q_len])
    md = build_metadata([q_len], [seq_len], tables, block_size, 0)
    q, k, v = qkv_views(q_len, hq, hkv, d, dtype, seed=7)
    with torch.no_grad():
        got = attention_forward(q, k, v, k_cache, v_cache, md, d**-0.5)
    max_query, max_context = paged_segment_limits(dtype, d)
    assert calls == ([[0]] if q_len <= max_query and seq_len <= max_context else [])
    if bf16_pair_engine() == "avx512_bf16":
        assert calls == [[0]]
    positions = torch.arange(seq_len)
    slots = tables[0, positions // block_size].long() * block_size + positions % block_size
    keys, values = (c.view(-1, hkv, d)[slots].double().repeat_interleave(hq // hkv, 1) for c in (k_cache, v_cache))
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * d**-0.5  # [H, Q, S]
    visible = positions[None, :] <= positions[seq_len - q_len :, None]  # [Q, S]
    want = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)
    assert (got.double() - want).abs().max().item() < tol


def test_a_row_does_not_depend_on_its_chunk():
    # the same sequence computed fresh and with its first 32 positions cached: the shared query rows are bitwise
    # equal (a prefix-cache hit does not change the last bits)
    torch.manual_seed(5)
    hq, hkv, d, block_size, seq_len = 4, 2, 32, 16, 70
    tables = torch.arange(1, 6, dtype=torch.int32).view(1, 5)
    q, k, v = qkv_views(seq_len, hq, hkv, d, torch.float32, seed=6)
    outs = []
    for cached in (0, 32):
        k_cache = torch.zeros(6, block_size, hkv, d)
        v_cache = torch.zeros_like(k_cache)
        flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
        flat_k[block_size : block_size + cached], flat_v[block_size : block_size + cached] = k[:cached], v[:cached]
        md = build_metadata([seq_len - cached], [seq_len], tables, block_size, 0)
        with torch.no_grad():
            outs.append(attention_forward(q[cached:], k[cached:], v[cached:], k_cache, v_cache, md, d**-0.5))
    assert torch.equal(outs[0][32:], outs[1])


def test_bf16_pairs_run_where_the_cpu_has_them():
    # a CPU with AVX512-BF16 multiplies bf16 heads of a multiple of 32 as pairs (vdpbf16ps, or AMX tiles where the
    # kernel may use them), not widened to float32
    if varlen_attention_cpu_kernel() is None:
        pytest.skip("the kernel cannot be built here")
    expected = {None} if not torch.cpu._is_avx512_bf16_supported() else {"avx512_bf16", "amx"}
    assert bf16_pair_engine() in expected
