"""Torch implementation of the paged KV-cache write (reshape-and-cache)."""
from __future__ import annotations

import torch


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value rows into the paged caches at their flat slots; slot -1 is skipped."""
    # key, value: [T, Hkv, D]; k_cache, v_cache: [NB, BS, Hkv, D]; slot_mapping: [T] int64
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)  # [NB*BS, Hkv, D]
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    slots = slot_mapping.to(torch.long)
    key = key[:num_tokens]
    value = value[:num_tokens]
    valid = slots >= 0  # [T]
    if not bool(valid.all()):
        slots = slots[valid]
        key = key[valid]
        value = value[valid]
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))
