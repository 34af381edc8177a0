"""Paged varlen prefill and attention_forward: reference vs a plain loop, Triton vs reference."""

from __future__ import annotations

import itertools

import pytest
import torch
from _kernel_testutils import (
    build_metadata,
    kernel_tol,
    make_paged_kv,
    metadata_to,
    naive_attention,
    poison_unused_slots,
    to_device,
)

from vlserve.kernels.attention_ref import attention_forward_ref, paged_prefill_attention_ref

GQA_RATIOS = [1, 2, 4, 8]
HEAD_DIMS = [64, 80, 96, 128]
BLOCK_SIZES = [16, 32]


def _prefill_case(ratio, head_dim, block_size, seqs, num_kv_heads=2, dtype=torch.float32, seed=0):
    """seqs: (cached_prefix_len, q_len) per sequence; the new tokens are the last q_len positions."""
    g = torch.Generator().manual_seed(seed)
    num_q_heads = num_kv_heads * ratio
    contexts = []
    for prefix, q_len in seqs:
        n = prefix + q_len
        contexts.append(
            (
                torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype),
                torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype),
            )
        )
    k_cache, v_cache, tables = make_paged_kv(contexts, block_size, generator=g)
    q_lens = [q for _, q in seqs]
    seq_lens = [p + q for p, q in seqs]
    qsl = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), num_q_heads, head_dim, generator=g).to(dtype)
    return query, contexts, k_cache, v_cache, tables, qsl, torch.tensor(seq_lens, dtype=torch.int32)


def _naive_prefill(query, contexts, qsl, scale):
    out = torch.zeros_like(query)
    for b, (k, v) in enumerate(contexts):
        start, end = int(qsl[b]), int(qsl[b + 1])
        if end > start:
            first = k.shape[0] - (end - start)
            out[start:end] = naive_attention(query[start:end], k, v, list(range(first, k.shape[0])), scale)
    return out


def _seqs(block_size):
    # fresh prompt, cached prefix ending mid-block + chunk ending mid-block, single new token after a
    # full block, empty (q_len 0) sequence, and a one-token prompt
    return [(0, 9), (block_size + 3, block_size // 2 + 1), (block_size, 1), (5, 0), (0, 1)]


@pytest.mark.parametrize(
    "ratio,head_dim,block_size",
    list(itertools.product(GQA_RATIOS, HEAD_DIMS, BLOCK_SIZES)) + [(7, 128, 16), (6, 64, 32)],
)
def test_prefill_ref_matches_naive(ratio, head_dim, block_size):
    query, contexts, k_cache, v_cache, tables, qsl, lens = _prefill_case(ratio, head_dim, block_size, _seqs(block_size))
    scale = head_dim**-0.5
    out = paged_prefill_attention_ref(query, k_cache, v_cache, tables, qsl, lens, scale)
    torch.testing.assert_close(out, _naive_prefill(query, contexts, qsl, scale), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_ignores_nan_in_unwritten_slots(backend, request, device):
    seqs = [(19, 6), (0, 5), (3, 0)]
    query, contexts, k_cache, v_cache, tables, qsl, lens = _prefill_case(2, 64, 16, seqs, num_kv_heads=1, seed=6)
    poison_unused_slots(k_cache, v_cache, tables, lens.tolist())
    expected = _naive_prefill(query, contexts, qsl, 0.125)
    if backend == "torch":
        out = paged_prefill_attention_ref(query, k_cache, v_cache, tables, qsl, lens, 0.125)
        tol = kernel_tol("cpu", torch.float32)
    else:
        prefill = request.getfixturevalue("triton_kernels").prefill
        out = prefill.paged_prefill_attention_triton(
            *to_device(device, query, k_cache, v_cache, tables, qsl, lens), 0.125
        ).cpu()
        tol = kernel_tol(device, torch.float32)
    torch.testing.assert_close(out, expected, **tol)


def test_prefill_ref_bf16():
    seqs = [(40, 24), (0, 33)]
    query, contexts, k_cache, v_cache, tables, qsl, lens = _prefill_case(4, 128, 16, seqs, dtype=torch.bfloat16)
    out = paged_prefill_attention_ref(query, k_cache, v_cache, tables, qsl, lens, 128**-0.5)
    ref = _naive_prefill(query.float(), [(k.float(), v.float()) for k, v in contexts], qsl, 128**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


TRITON_CASES = [(1, 64, 16), (2, 80, 32), (4, 96, 16), (8, 128, 32), (7, 128, 16)]  # 7: non-power-of-two group


@pytest.mark.parametrize("ratio,head_dim,block_size", TRITON_CASES)
def test_prefill_triton_matches_ref(triton_kernels, device, ratio, head_dim, block_size):
    seqs = [(0, 9), (block_size + 3, 20), (5, 0), (0, 1)]
    query, _, k_cache, v_cache, tables, qsl, lens = _prefill_case(ratio, head_dim, block_size, seqs, num_kv_heads=1)
    scale = head_dim**-0.5
    ref = paged_prefill_attention_ref(query, k_cache, v_cache, tables, qsl, lens, scale)
    out = triton_kernels.prefill.paged_prefill_attention_triton(
        *to_device(device, query, k_cache, v_cache, tables, qsl, lens), scale
    )
    assert out.device.type == device.type
    torch.testing.assert_close(out.cpu(), ref, **kernel_tol(device, torch.float32))


def test_prefill_triton_bf16(triton_kernels, device):
    seqs = [(17, 12), (0, 5)]
    query, _, k_cache, v_cache, tables, qsl, lens = _prefill_case(2, 64, 16, seqs, num_kv_heads=1, dtype=torch.bfloat16)
    ref = paged_prefill_attention_ref(query, k_cache, v_cache, tables, qsl, lens, 0.125)
    out = triton_kernels.prefill.paged_prefill_attention_triton(
        *to_device(device, query, k_cache, v_cache, tables, qsl, lens), 0.125, max_query_len=12
    )
    torch.testing.assert_close(out.float().cpu(), ref.float(), **kernel_tol(device, torch.bfloat16))


def _forward_case(block_size, num_kv_heads, ratio, head_dim, seed=0, num_padding_tokens=2):
    """Two decodes and two prefill chunks; the step's own K/V are NOT yet in the cache."""
    g = torch.Generator().manual_seed(seed)
    seqs = [(20, 1), (block_size - 1, 1), (0, 7), (block_size + 2, 5)]  # (prefix, q_len)
    contexts = [tuple(torch.randn(p + q, num_kv_heads, head_dim, generator=g) for _ in range(2)) for p, q in seqs]
    # cache holds only the prefixes (a zero placeholder token for an empty one, overwritten by the
    # step); the new tokens' K/V arrive through attention_forward
    prefixes = [(k[:p], v[:p]) if p else (k[:1] * 0, v[:1] * 0) for (k, v), (p, _) in zip(contexts, seqs)]
    k_cache, v_cache, tables = make_paged_kv(prefixes, block_size, generator=g)
    q_lens = [q for _, q in seqs]
    seq_lens = [p + q for p, q in seqs]
    md = build_metadata(q_lens, seq_lens, tables, block_size, num_decodes=2, num_padding_tokens=num_padding_tokens)
    padding = [torch.randn(num_padding_tokens, num_kv_heads, head_dim)]
    key = torch.cat([k[p:] for (k, _), (p, _) in zip(contexts, seqs)] + padding)
    value = torch.cat([v[p:] for (_, v), (p, _) in zip(contexts, seqs)] + padding)
    query = torch.randn(key.shape[0], num_kv_heads * ratio, head_dim, generator=g)
    qsl = torch.tensor(md.query_start_loc_cpu)
    expected = torch.zeros_like(query)
    expected[: int(qsl[-1])] = _naive_prefill(query[: int(qsl[-1])], contexts, qsl, head_dim**-0.5)
    return query, key, value, k_cache, v_cache, md, expected


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_attention_forward_ref_matches_naive(block_size):
    query, key, value, k_cache, v_cache, md, expected = _forward_case(block_size, 2, 4, 64)
    out = attention_forward_ref(query, key, value, k_cache, v_cache, md, 64**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_attention_forward_triton_matches_ref(triton_kernels, device):
    query, key, value, k_cache, v_cache, md, expected = _forward_case(16, 1, 2, 64, seed=3)
    q2, key2, value2, k2, v2 = to_device(device, query, key, value, k_cache, v_cache)
    ref = attention_forward_ref(query, key, value, k_cache, v_cache, md, 0.125)
    out = triton_kernels.attention.attention_forward_triton(q2, key2, value2, k2, v2, metadata_to(md, device), 0.125)
    tol = kernel_tol(device, torch.float32)
    torch.testing.assert_close(out.cpu(), ref, **tol)
    torch.testing.assert_close(out.cpu(), expected, **tol)
    assert torch.equal(k2.cpu(), k_cache) and torch.equal(v2.cpu(), v_cache)
