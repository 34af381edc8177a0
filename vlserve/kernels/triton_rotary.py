"""Triton NeoX-style rotary embedding (and Qwen2-VL M-RoPE), in place on query and key."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_t,
    stride_h,
    t,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
):
    # x[t]: [H, D]; rotates [:, :HALF] with [:, HALF:2*HALF]; cos, sin: [HALF_P2] float32
    h = tl.arange(0, HEADS_P2)
    j = tl.arange(0, HALF_P2)
    mask = (h < NUM_HEADS)[:, None] & (j < HALF)[None, :]
    ptr1 = x_ptr + t.to(tl.int64) * stride_t + h[:, None] * stride_h + j[None, :]
    ptr2 = ptr1 + HALF
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr2, mask=mask, other=0.0)
    # match HF: cos/sin rounded to x's dtype first
    c = cos.to(x1.dtype).to(tl.float32)[None, :]
    s = sin.to(x1.dtype).to(tl.float32)[None, :]
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = x1f * c - x2f * s
    o2 = x2f * c + x1f * s
    tl.store(ptr1, o1.to(x1.dtype), mask=mask)
    tl.store(ptr2, o2.to(x2.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_pos_axis,
    stride_cos,
    SEC0: tl.constexpr,
    SEC01: tl.constexpr,
    IS_MROPE: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    Q_HEADS_P2: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_P2: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
):
    # one program per token t
    t = tl.program_id(0)
    j = tl.arange(0, HALF_P2)
    if IS_MROPE:
        # frequency j takes its position from axis 0 (t), 1 (h) or 2 (w) by mrope section
        p0 = tl.load(pos_ptr + t)
        p1 = tl.load(pos_ptr + stride_pos_axis + t)
        p2 = tl.load(pos_ptr + 2 * stride_pos_axis + t)
        pos = tl.where(j < SEC0, p0, tl.where(j < SEC01, p1, p2))
    else:
        pos = tl.load(pos_ptr + t + j * 0)
    jm = j < HALF
    off = pos.to(tl.int64) * stride_cos + j
    cos = tl.load(cos_ptr + off, mask=jm, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + off, mask=jm, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, stride_qt, stride_qh, t, cos, sin, NUM_Q_HEADS, Q_HEADS_P2, HALF, HALF_P2)
    _rotate_heads(k_ptr, stride_kt, stride_kh, t, cos, sin, NUM_KV_HEADS, KV_HEADS_P2, HALF, HALF_P2)


def apply_rotary_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    mrope_section: list[int] | None = None,
) -> None:
    """Rotate the first R dims of query and key in place (NeoX halves; M-RoPE if positions is [3, T])."""
    # query: [T, Hq, D]; key: [T, Hkv, D]; positions: [T] or [3, T] int64; cos/sin_cache: [P, R/2]
    num_tokens, num_q_heads, _ = query.shape
    num_kv_heads = key.shape[1]
    if num_tokens == 0:
        return
    half = cos_cache.shape[-1]
    assert query.stride(-1) == 1 and key.stride(-1) == 1
    assert cos_cache.stride(-1) == 1 and cos_cache.stride() == sin_cache.stride()
    if positions.dim() == 2:
        if mrope_section is None:
            raise ValueError("positions of shape [3, T] need mrope_section")
        if sum(mrope_section) != half:
            raise ValueError(f"sum(mrope_section)={sum(mrope_section)} must equal rotary_dim/2={half}")
        positions = positions.contiguous()
        sec0, sec01 = mrope_section[0], mrope_section[0] + mrope_section[1]
        is_mrope, stride_axis = True, positions.stride(0)
    else:
        positions = positions.contiguous()
        sec0, sec01, is_mrope, stride_axis = half, half, False, 0
    _rotary_kernel[(num_tokens,)](
        query,
        key,
        positions,
        cos_cache,
        sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        stride_axis,
        cos_cache.stride(0),
        SEC0=sec0,
        SEC01=sec01,
        IS_MROPE=is_mrope,
        NUM_Q_HEADS=num_q_heads,
        Q_HEADS_P2=triton.next_power_of_2(num_q_heads),
        NUM_KV_HEADS=num_kv_heads,
        KV_HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HALF=half,
        HALF_P2=triton.next_power_of_2(half),
    )
