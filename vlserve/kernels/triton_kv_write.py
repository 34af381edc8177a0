"""Triton reshape-and-cache: scatter this step's K/V rows into the paged caches."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
):
    # one program per token; key/value rows: [Hkv, D] -> cache[slot // BS, slot % BS, :, :]
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, HEADS_P2)
        d = tl.arange(0, HEAD_DIM_P2)
        mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h[:, None] * stride_ch + d[None, :]
        k = tl.load(key_ptr + t.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        v = tl.load(value_ptr + t.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value rows into the paged caches at their flat slots; slot -1 is skipped."""
    # key, value: [T, Hkv, D] (last dim contiguous); k_cache, v_cache: [NB, BS, Hkv, D]; slot_mapping: [T]
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=triton.next_power_of_2(head_dim),
    )
