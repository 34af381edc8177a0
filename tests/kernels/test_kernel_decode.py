"""Paged decode attention: torch reference vs a plain loop, and the Triton kernel vs the reference."""

from __future__ import annotations

import itertools

import pytest
import torch
from _kernel_testutils import kernel_tol, make_paged_kv, naive_attention, poison_unused_slots, to_device

from vlserve.kernels import attention_ref
from vlserve.kernels.attention_ref import paged_attention_decode_ref

GQA_RATIOS = [1, 2, 4, 8]
HEAD_DIMS = [64, 80, 96, 128]
BLOCK_SIZES = [16, 32]


def _decode_case(ratio, head_dim, block_size, seq_lens, num_kv_heads=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_q_heads = num_kv_heads * ratio
    contexts = [
        tuple(torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype) for _ in range(2)) for n in seq_lens
    ]
    k_cache, v_cache, tables = make_paged_kv(contexts, block_size, generator=g)
    query = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=g).to(dtype)
    return query, contexts, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


def _naive_decode(query, contexts, scale):
    rows = [naive_attention(query[b : b + 1], k, v, [k.shape[0] - 1], scale)[0] for b, (k, v) in enumerate(contexts)]
    return torch.stack(rows)


@pytest.mark.parametrize(
    "ratio,head_dim,block_size",
    list(itertools.product(GQA_RATIOS, HEAD_DIMS, BLOCK_SIZES)) + [(7, 128, 16), (6, 64, 32)],
)
def test_decode_ref_matches_naive(ratio, head_dim, block_size):
    # lengths: single token, mid-block, exactly one block, several blocks ending mid-block
    seq_lens = [1, block_size // 2 + 3, block_size, 3 * block_size + 7]
    query, contexts, k_cache, v_cache, tables, lens = _decode_case(ratio, head_dim, block_size, seq_lens)
    scale = head_dim**-0.5
    out = paged_attention_decode_ref(query, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(out, _naive_decode(query, contexts, scale), atol=2e-5, rtol=1e-5)


def test_decode_ref_full_blocks_without_padding():
    # every context fills whole blocks, so the reference skips its padding mask
    query, contexts, k_cache, v_cache, tables, lens = _decode_case(2, 64, 16, [32, 32, 32], seed=4)
    out = paged_attention_decode_ref(query, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(out, _naive_decode(query, contexts, 0.125), atol=2e-5, rtol=1e-5)
    # one length that ends mid-block: SDPA reads exactly that many keys, again without a mask
    query, contexts, k_cache, v_cache, tables, lens = _decode_case(2, 64, 16, [37, 37, 37], seed=4)
    poison_unused_slots(k_cache, v_cache, tables, [37, 37, 37])
    out = paged_attention_decode_ref(query, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(out, _naive_decode(query, contexts, 0.125), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_bytes", [1, 40_000, 1 << 30])
@pytest.mark.parametrize("seq_lens", [[5, 33, 1, 64, 17, 90, 2], [90, 64, 33, 17, 5, 2, 1]])
def test_decode_ref_chunking_and_kwargs(monkeypatch, chunk_bytes, seq_lens):
    # one sequence per chunk, a few per chunk, and the whole batch at once must agree; sequences are
    # processed longest first (shuffled order) or in place (already sorted)
    monkeypatch.setattr(attention_ref, "DECODE_CHUNK_BYTES", chunk_bytes)
    query, contexts, k_cache, v_cache, tables, lens = _decode_case(4, 64, 16, seq_lens, seed=1)
    out = torch.full_like(query, float("nan"))
    with torch.inference_mode():
        ret = paged_attention_decode_ref(query, k_cache, v_cache, tables, lens, 0.125, max_seq_len=90, out=out)
    assert ret is out
    torch.testing.assert_close(out, _naive_decode(query, contexts, 0.125), atol=2e-5, rtol=1e-5)
    # the workspace made inside inference mode must still be usable outside it
    out2 = paged_attention_decode_ref(query, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(out2, out)


def test_decode_ref_bf16():
    seq_lens = [3, 40, 77]
    query, contexts, k_cache, v_cache, tables, lens = _decode_case(2, 128, 32, seq_lens, dtype=torch.bfloat16, seed=2)
    out = paged_attention_decode_ref(query, k_cache, v_cache, tables, lens, 128**-0.5)
    assert out.dtype == torch.bfloat16
    ref = _naive_decode(query.float(), [(k.float(), v.float()) for k, v in contexts], 128**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_decode_ref_empty_batch():
    query, _, k_cache, v_cache, tables, lens = _decode_case(1, 64, 16, [4])
    out = paged_attention_decode_ref(query[:0], k_cache, v_cache, tables[:0], lens[:0], 1.0)
    assert out.shape == (0, 2, 64)


# Triton (compiled on CUDA, interpreted on CPU): one case per GQA ratio, covering every head dim and
# block size; small sizes. plus a non-power-of-two group (Qwen2.5-VL-7B: 28 query heads over 4 KV heads).
TRITON_CASES = [(1, 64, 16), (2, 80, 32), (4, 96, 16), (8, 128, 32), (7, 128, 16)]


@pytest.mark.parametrize("ratio,head_dim,block_size", TRITON_CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_triton_matches_ref(triton_kernels, device, ratio, head_dim, block_size, num_splits):
    seq_lens = [1, block_size + 5, 150] if num_splits > 1 else [1, block_size + 5]
    query, _, k_cache, v_cache, tables, lens = _decode_case(ratio, head_dim, block_size, seq_lens, num_kv_heads=1)
    scale = head_dim**-0.5
    ref = paged_attention_decode_ref(query, k_cache, v_cache, tables, lens, scale)
    out = triton_kernels.attention.paged_attention_decode_triton(
        *to_device(device, query, k_cache, v_cache, tables, lens),
        scale,
        max_seq_len=max(seq_lens),
        num_splits=num_splits,
    )
    assert out.device.type == device.type
    torch.testing.assert_close(out.cpu(), ref, **kernel_tol(device, torch.float32))


def test_decode_triton_bf16_default_splits(triton_kernels, device):
    seq_lens = [7, 200]
    query, _, k_cache, v_cache, tables, lens = _decode_case(4, 64, 16, seq_lens, num_kv_heads=1, dtype=torch.bfloat16)
    ref = paged_attention_decode_ref(query, k_cache, v_cache, tables, lens, 0.125)
    out = triton_kernels.attention.paged_attention_decode_triton(  # bound from table width
        *to_device(device, query, k_cache, v_cache, tables, lens), 0.125
    )
    torch.testing.assert_close(out.float().cpu(), ref.float(), **kernel_tol(device, torch.bfloat16))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_triton_zero_length_padding_row(triton_kernels, device, num_splits):
    # CUDA-graph style padding rows (seq_len 0) must come out as zeros, not NaN
    query, _, k_cache, v_cache, tables, lens = _decode_case(2, 64, 16, [70, 9], num_kv_heads=1)
    lens[1] = 0
    out = triton_kernels.attention.paged_attention_decode_triton(
        *to_device(device, query, k_cache, v_cache, tables, lens), 0.125, max_seq_len=70, num_splits=num_splits
    ).cpu()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = paged_attention_decode_ref(query[:1], k_cache, v_cache, tables[:1], lens[:1], 0.125)
    torch.testing.assert_close(out[:1], ref, **kernel_tol(device, torch.float32))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_ignores_nan_in_unwritten_slots(backend, request, device):
    seq_lens = [3, 40, 17, 64]
    query, contexts, k_cache, v_cache, tables, lens = _decode_case(4, 64, 16, seq_lens, num_kv_heads=1, seed=5)
    poison_unused_slots(k_cache, v_cache, tables, seq_lens)
    expected = _naive_decode(query, contexts, 0.125)
    if backend == "torch":
        out = paged_attention_decode_ref(query, k_cache, v_cache, tables, lens, 0.125)
        tol = kernel_tol("cpu", torch.float32)
    else:
        attention = request.getfixturevalue("triton_kernels").attention
        out = attention.paged_attention_decode_triton(
            *to_device(device, query, k_cache, v_cache, tables, lens), 0.125, num_splits=2
        ).cpu()
        tol = kernel_tol(device, torch.float32)
    torch.testing.assert_close(out, expected, **tol)
