"""What the Triton paged-attention kernels share: the K/V tile gather from the paged cache and small host helpers
(the varlen kernel takes its constants from here too).

Key positions are mapped to cache slots token by token (`block_table[p // BS] * BS + p % BS`), so a tile need not
align with cache blocks. FP8 caches (float8_e4m3fn, `kv_quant`) are dequantized as their tiles are loaded: times the
layer's k_scale / v_scale in float32 (the kernels then cast the tile to the query's dtype for the dot products).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MIN_DOT = 16  # tl.dot needs every dimension >= 16


@triton.jit
def load_kv_tile(
    cache_ptr,
    bt_row_ptr,
    n,
    n_mask,
    kv_head,
    d,
    d_mask,
    stride_cb,
    stride_cs,
    stride_ch,
    kv_scale,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    MASK_N: tl.constexpr,
    MASK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    # rows of cache for token positions n: [BLOCK_N, HEAD_DIM_P2]. MASK_N=False: every n is a valid position;
    # MASK_D=False: the head dim is a power of two (no padded columns). Unmasked loads vectorize fully.
    # FP8: the tile comes back dequantized, float32 times kv_scale
    if MASK_N:
        blk = tl.load(bt_row_ptr + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row_ptr + n // BLOCK_SIZE).to(tl.int64)
    row = blk * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    ptrs = cache_ptr + row[:, None] + d[None, :]
    if MASK_N:
        if MASK_D:
            tile = tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        else:
            tile = tl.load(ptrs, mask=n_mask[:, None], other=0.0)
    else:
        if MASK_D:
            tile = tl.load(ptrs, mask=d_mask[None, :], other=0.0)
        else:
            tile = tl.load(ptrs)
    if FP8:
        tile = tile.to(tl.float32) * kv_scale
    elif UPCAST:
        tile = tile.to(tl.float32)
    return tile


def upcast_dots(query: torch.Tensor) -> bool:
    """Triton's CPU interpreter computes bf16 tl.dot wrongly; the kernels upcast the operands there (only there)."""
    return query.device.type != "cuda" and query.dtype == torch.bfloat16


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The kernels index both caches with one set of strides."""
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, "caches must share a row-major layout"
