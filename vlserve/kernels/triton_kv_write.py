"""Triton reshape-and-cache: scatter this step's K/V rows into the paged caches.

FP8 caches (float8_e4m3fn, `kv_quant`) store `clamp(x / scale, -448, 448)` rounded to the nearest e4m3 value (ties
to even): on a GPU by the hardware conversion; under Triton's CPU interpreter, whose float32 -> fp8 cast drops the
carry when the mantissa rounds up (1.95 -> 1.0), the value is first rounded onto the e4m3 grid in float32
(`_round_to_e4m3`), so that the cast is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlserve.kernels.kv_quant import is_fp8


@triton.jit
def _round_to_e4m3(x):
    # x: float32 in [-448, 448] -> the nearest float8_e4m3fn value (ties to even), still float32
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    # normal numbers (|x| >= 2^-6): keep 3 mantissa bits, round to nearest even (a carry moves the exponent)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # subnormals: multiples of 2^-9, rounded by a float32 add at the scale where its ulp is 2^-9
    sub = (a + 24576.0) - 24576.0
    r = tl.where(a >= 0.015625, normal, sub)
    return tl.where(x < 0, -r, r)


@triton.jit
def _to_cache(x, scale, cache_ptr, FP8: tl.constexpr, ROUND_FP8: tl.constexpr):
    # x: [HEADS_P2, HEAD_DIM_P2] rows in the input dtype -> the cache's element type (448: kv_quant.FP8_MAX)
    if FP8:
        x = tl.clamp(x.to(tl.float32) / scale, -448.0, 448.0)
        if ROUND_FP8:
            x = _round_to_e4m3(x)
    return x.to(cache_ptr.dtype.element_ty)


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
    k_scale,
    v_scale,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    FP8: tl.constexpr,
    ROUND_FP8: tl.constexpr,
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
        tl.store(k_cache_ptr + dst, _to_cache(k, k_scale, k_cache_ptr, FP8, ROUND_FP8), mask=mask)
        v = tl.load(value_ptr + t.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(v_cache_ptr + dst, _to_cache(v, v_scale, v_cache_ptr, FP8, ROUND_FP8), mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter key/value rows into the paged caches at their flat slots; slot -1 is skipped. FP8 caches store
    `clamp(x / scale, +-448)` as float8_e4m3fn; other caches ignore the scales."""
    # key, value: [T, Hkv, D] (last dim contiguous); k_cache, v_cache: [NB, BS, Hkv, D]; slot_mapping: [T]
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.dtype == v_cache.dtype
    fp8 = is_fp8(k_cache)
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
        float(k_scale),
        float(v_scale),
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=triton.next_power_of_2(head_dim),
        FP8=fp8,
        ROUND_FP8=fp8 and key.device.type != "cuda",
    )
