"""Triton bidirectional varlen attention over contiguous K/V (vision towers: one call for every item of a step).

Segment b is rows [cu_seqlens[b], cu_seqlens[b+1]) of query/key/value and attends only to itself, so the batch is
block-diagonal. One program computes BLOCK_M query rows of one head of one segment with an online softmax over
that segment's keys in BLOCK_N tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlserve.kernels.triton_paged import LOG2E, MIN_DOT


@triton.jit
def _varlen_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cu_ptr,
    out_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # grid: (cdiv(max_seqlen, BLOCK_M), B, Hq)
    m0 = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(cu_ptr + b)
    seq_len = tl.load(cu_ptr + b + 1) - start
    if m0 < seq_len:
        kv_head = head // GROUP
        m = m0 + tl.arange(0, BLOCK_M)
        m_mask = m < seq_len
        d = tl.arange(0, HEAD_DIM_P2)
        d_mask = d < HEAD_DIM
        rows = (start + m).to(tl.int64)  # [BLOCK_M]
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, HEAD_DIM_P2]
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
        for n0 in range(0, seq_len, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < seq_len
            kv_rows = (start + n).to(tl.int64)  # [BLOCK_N]
            tile_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(
                k_ptr + kv_rows[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=tile_mask, other=0.0
            )  # [BLOCK_N, HEAD_DIM_P2]
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [BLOCK_M, BLOCK_N]
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds at least one key
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_ptr + kv_rows[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=tile_mask, other=0.0
            )
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & d_mask[None, :],
        )


def varlen_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    max_seqlen: int | None = None,
    cu_seqlens_cpu: list[int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bidirectional varlen attention over contiguous K/V: segment b (rows cu_seqlens[b]..cu_seqlens[b+1]) attends
    only to itself (a block-diagonal mask). Rows past cu_seqlens[-1] come out zero."""
    # query: [T, Hq, D]; key, value: [T, Hkv, D]; cu_seqlens: [B+1] int32; returns [T, Hq, D]
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = cu_seqlens.shape[0] - 1
    if out is None:
        out = torch.zeros_like(query)
    if max_seqlen is None:
        bounds = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.tolist()
        max_seqlen = max((e - s for s, e in zip(bounds[:-1], bounds[1:])), default=0)
    if num_seqs <= 0 or num_tokens == 0 or max_seqlen == 0:
        return out
    for t in (query, key, value, out):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    block_m = min(64, max(MIN_DOT, triton.next_power_of_2(max_seqlen)))
    upcast = query.device.type != "cuda" and query.dtype == torch.bfloat16  # the CPU interpreter's bf16 dot is off
    _varlen_kernel[(triton.cdiv(max_seqlen, block_m), num_seqs, num_q_heads)](
        query,
        key,
        value,
        cu_seqlens,
        out,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=num_q_heads // key.shape[1],
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=32,
        UPCAST=upcast,
    )
    return out


__all__ = ["varlen_attention_triton"]
