"""Torch implementation of the paged KV-cache write (reshape-and-cache); FP8 caches store `quantize_kv(x, scale)`."""

from __future__ import annotations

import torch

from vlserve.kernels.kv_quant import is_fp8, kv_bytes, quantize_kv


def valid_slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(slots, rows)`: the int64 flat slots to write and the token rows they come from (None: every row; slot -1
    marks padding to skip). Depends only on the step, so the attention computes it once for all layers."""
    # slot_mapping: [T] -> slots [T'] int64, rows [T'] int64 or None
    slots = slot_mapping.to(torch.long)
    valid = slots >= 0  # [T]
    if bool(valid.all()):
        return slots, None
    rows = valid.nonzero().squeeze(1)
    return slots[rows], rows


def write_kv_slots(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots_and_rows: tuple[torch.Tensor, torch.Tensor | None],
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter key/value rows into the caches at `valid_slots`' slots (FP8 caches: divided by k_scale / v_scale,
    clamped and rounded to float8_e4m3fn)."""
    # key, value: [T, Hkv, D]; k_cache, v_cache: [NB, BS, Hkv, D]
    slots, rows = slots_and_rows
    if slots.shape[0] == 0:
        return
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if rows is None:
        key, value = key[: slots.shape[0]], value[: slots.shape[0]]
    else:
        key, value = key[rows], value[rows]
    if is_fp8(k_cache):  # torch has no float8 index_copy_ on CPU: copy the bytes
        kv_bytes(k_cache).view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(
            0, slots, kv_bytes(quantize_kv(key, k_scale))
        )
        kv_bytes(v_cache).view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(
            0, slots, kv_bytes(quantize_kv(value, v_scale))
        )
        return
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))


def write_kv_cache_ref(
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
    `quantize_kv(key, k_scale)` and `quantize_kv(value, v_scale)`; other caches ignore the scales."""
    # key, value: [T, Hkv, D]; k_cache, v_cache: [NB, BS, Hkv, D]; slot_mapping: [T] int64
    write_kv_slots(key, value, k_cache, v_cache, valid_slots(slot_mapping), k_scale, v_scale)
