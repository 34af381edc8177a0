"""Triton paged attention: split-K decode (+ reduce) over the paged cache, and `attention_forward_triton`, one
layer's step (write this step's K/V, decode the decodes, prefill the rest through `triton_prefill`).

The decode kernel gives one program a whole GQA group (the Hq/Hkv query heads that share one KV head), so each K/V
tile is loaded once per group. With a sliding window W a sequence's splits cover only its last W positions
(`window`: the keys below are never loaded). FP8 caches: tiles are dequantized as they are loaded
(`triton_paged.load_kv_tile`).

Key limits (`md.key_limits`, Gemma 3's bidirectional image tokens): when a prefill token of the step may attend past
its own position, `attention_forward_triton` runs the step's prefill sequences through the torch reference path
(`attention_ref.prefill_ref`, on the GPU) instead of `triton_prefill`; the decodes stay on the decode kernel.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vlserve.kernels.attention_ref import prefill_ref
from vlserve.kernels.key_limits import bidirectional_prefills
from vlserve.kernels.kv_quant import is_fp8
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.kernels.triton_kv_write import write_kv_cache_triton
from vlserve.kernels.triton_paged import LOG2E, MIN_DOT, check_cache, load_kv_tile, upcast_dots
from vlserve.kernels.triton_prefill import paged_prefill_attention_triton


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    scale_log2,
    split_len,
    num_splits,
    window,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_btb,
    stride_ob,
    stride_oh,
    k_scale,
    v_scale,
    BLOCK_SIZE: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    FP8: tl.constexpr,
):
    # grid: (B, Hkv, num_splits); program covers key positions [lo + split * split_len, +split_len) of one group,
    # lo: the first position attended (0, or seq_len - window with a sliding window; window <= 0: none)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, HEAD_DIM_P2)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q_head = kv_head * GROUP + g  # [GROUP_P2]
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + q_head[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [GROUP_P2, HEAD_DIM_P2]
    if UPCAST:
        q = q.to(tl.float32)
    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_btb

    m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM_P2], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        k = load_kv_tile(
            k_cache_ptr,
            bt_row_ptr,
            n,
            n_mask,
            kv_head,
            d,
            d_mask,
            stride_cb,
            stride_cs,
            stride_ch,
            k_scale,
            BLOCK_SIZE,
            UPCAST,
            True,
            HEAD_DIM != HEAD_DIM_P2,
            FP8,
        )  # [BLOCK_N, HEAD_DIM_P2]
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * scale_log2  # [GROUP_P2, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv_tile(
            v_cache_ptr,
            bt_row_ptr,
            n,
            n_mask,
            kv_head,
            d,
            d_mask,
            stride_cb,
            stride_cs,
            stride_ch,
            v_scale,
            BLOCK_SIZE,
            UPCAST,
            True,
            HEAD_DIM != HEAD_DIM_P2,
            FP8,
        ).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE_SPLIT:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # seq_len 0 (padding row) -> zeros
        o_ptr = out_ptr + b.to(tl.int64) * stride_ob + q_head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # partials: acc [B, Hq, S, D], m/l [B, Hq, S] (float32, contiguous); empty splits leave m=-inf, l=0
        row = (b.to(tl.int64) * NUM_Q_HEADS + q_head) * num_splits + split  # [GROUP_P2]
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=mask)
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_splits,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    # grid: (B, Hq); merges the num_splits online-softmax partials of one (sequence, head)
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, HEAD_DIM_P2)
    s_mask = sp < num_splits
    row = (b.to(tl.int64) * NUM_Q_HEADS + h) * num_splits + sp  # [SPLITS_P2]
    m = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)  # finite unless seq_len == 0 (padding row)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # [SPLITS_P2], 0 for empty splits
    acc = tl.load(
        part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0
    )
    denom = tl.sum(l * w, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_num_splits(num_seqs: int, num_kv_heads: int, max_len: int, block_n: int, device: torch.device) -> int:
    # enough (sequence, kv-head, split) programs to fill the GPU, each with at least a few key tiles
    if device.type == "cuda":
        target = 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    else:
        target = 8
    programs = num_seqs * num_kv_heads
    if programs >= target:
        return 1
    by_len = max(1, max_len // (4 * block_n))
    return max(1, min(by_len, triton.cdiv(target, programs), 64))


def paged_attention_decode_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    workspace: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence (at position seq_len-1) attending to its seq_len cached keys, or its last
    `sliding_window` of them (FP8 caches: dequantized with k_scale / v_scale)."""
    del workspace  # the torch path's scratch buffer; the kernel needs none
    # query: [B, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D]; block_tables: [B, M] int32; seq_lens: [B]
    num_seqs, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if out is None:
        out = query.new_empty(num_seqs, num_q_heads, head_dim)
    if num_seqs == 0:
        return out
    check_cache(k_cache, v_cache)
    assert query.stride(-1) == 1 and out.stride(-1) == 1 and block_tables.stride(-1) == 1
    block_n = 64
    max_len = max(1, max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size)
    if sliding_window is not None:
        max_len = min(max_len, sliding_window)  # keys any sequence attends to: the splits cover only those
    if num_splits is None:
        num_splits = _default_num_splits(num_seqs, num_kv_heads, max_len, block_n, query.device)
    split_len = triton.cdiv(triton.cdiv(max_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_len, split_len)
    if num_splits > 1:
        part_acc = torch.empty(num_seqs, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        part_m = torch.empty(num_seqs, num_q_heads, num_splits, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused
    head_dim_p2 = triton.next_power_of_2(head_dim)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_m,
        part_l,
        scale * LOG2E,
        split_len,
        num_splits,
        int(sliding_window or 0),
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        float(k_scale),
        float(v_scale),
        BLOCK_SIZE=block_size,
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        GROUP_P2=max(MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_p2,
        BLOCK_N=block_n,
        SINGLE_SPLIT=num_splits == 1,
        UPCAST=upcast_dots(query),
        FP8=is_fp8(k_cache),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            part_acc,
            part_m,
            part_l,
            out,
            out.stride(0),
            out.stride(1),
            num_splits,
            NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_P2=head_dim_p2,
            SPLITS_P2=triton.next_power_of_2(num_splits),
        )
    return out


def attention_forward_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then decode the first md.num_decodes sequences and prefill the rest
    (FP8 caches: written and read with k_scale / v_scale; `sliding_window` W: each query sees its last W positions;
    md.key_limits: the prefill sequences go through the torch path, see the module docstring)."""
    # query: [T, Hq, D]; key, value: [T, Hkv, D]; returns [T, Hq, D]
    write_kv_cache_triton(key, value, k_cache, v_cache, md.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    out = torch.empty_like(query)
    num_decodes = md.num_decodes
    num_actual = md.query_start_loc_cpu[-1]
    if num_actual < query.shape[0]:
        out[num_actual:].zero_()  # padding rows
    if num_decodes > 0:
        paged_attention_decode_triton(
            query[:num_decodes],
            k_cache,
            v_cache,
            md.block_tables[:num_decodes],
            md.seq_lens[:num_decodes],
            scale,
            max_seq_len=max(md.seq_lens_cpu[:num_decodes]),
            out=out[:num_decodes],
            k_scale=k_scale,
            v_scale=v_scale,
            sliding_window=sliding_window,
        )
    if num_decodes < md.num_seqs and md.key_limits is not None and bidirectional_prefills(md):
        # the GPU fallback for bidirectional tokens: no Triton kernel takes key limits
        prefill_ref(query, k_cache, v_cache, md, scale, out, k_scale, v_scale, sliding_window)
    elif num_decodes < md.num_seqs:
        # decode tokens come first, so the prefill sequences' query offsets are shifted by num_decodes
        qsl = md.query_start_loc[num_decodes:]
        qsl_cpu = md.query_start_loc_cpu[num_decodes:]
        max_q = max(b - a for a, b in zip(qsl_cpu[:-1], qsl_cpu[1:]))
        paged_prefill_attention_triton(
            query,
            k_cache,
            v_cache,
            md.block_tables[num_decodes:],
            qsl,
            md.seq_lens[num_decodes:],
            scale,
            max_query_len=max_q,
            out=out,
            k_scale=k_scale,
            v_scale=v_scale,
            sliding_window=sliding_window,
        )
    return out


__all__ = [
    "attention_forward_triton",
    "paged_attention_decode_triton",
]
