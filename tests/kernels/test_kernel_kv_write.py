"""write_kv_cache: reference vs a per-token loop, Triton vs reference."""

from __future__ import annotations

import pytest
import torch

from vlserve.kernels.kv_write_ref import write_kv_cache_ref


def _case(block_size, num_kv_heads, head_dim, dtype=torch.float32, seed=0, device="cpu"):
    """Seeded (same numbers for every device) caches, slots and strided key/value views, on `device`."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 6
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    # slots: block starts and ends, mid-block, the very last slot, with padding (-1) interleaved and at the end
    last = num_blocks * block_size - 1
    slots = torch.tensor([0, block_size - 1, -1, block_size, 3 * block_size + 5, last, -1, 2 * block_size + 7, -1])
    # key/value are strided views into a fused [T, (Hq + 2*Hkv) * D] projection, as a model produces them
    qkv = torch.randn(len(slots), (4 + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    qkv, k_cache, v_cache, slots = (t.to(device) for t in (qkv, k_cache, v_cache, slots))
    key = qkv[:, 4 * head_dim : (4 + num_kv_heads) * head_dim].view(-1, num_kv_heads, head_dim)
    value = qkv[:, (4 + num_kv_heads) * head_dim :].view(-1, num_kv_heads, head_dim)
    return key, value, k_cache, v_cache, slots


def _loop_write(key, value, k_cache, v_cache, slots):
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = key[t]
            v_cache[slot // block_size, slot % block_size] = value[t]
    return k_cache, v_cache


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (2, 80), (4, 96), (8, 128)])
def test_write_ref_matches_loop(block_size, num_kv_heads, head_dim):
    key, value, k_cache, v_cache, slots = _case(block_size, num_kv_heads, head_dim)
    exp_k, exp_v = _loop_write(key, value, k_cache, v_cache, slots)
    write_kv_cache_ref(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, exp_k) and torch.equal(v_cache, exp_v)


def test_write_ref_no_padding_and_empty():
    key, value, k_cache, v_cache, slots = _case(16, 2, 64, dtype=torch.bfloat16)
    keep = slots >= 0
    exp_k, exp_v = _loop_write(key[keep], value[keep], k_cache, v_cache, slots[keep])
    write_kv_cache_ref(key[keep], value[keep], k_cache, v_cache, slots[keep])
    assert torch.equal(k_cache, exp_k) and torch.equal(v_cache, exp_v)
    write_kv_cache_ref(key[:0], value[:0], k_cache, v_cache, slots[:0])
    assert torch.equal(k_cache, exp_k)


@pytest.mark.parametrize(
    "block_size,num_kv_heads,head_dim,dtype",
    [(16, 2, 80, torch.float32), (32, 8, 128, torch.float32), (16, 4, 64, torch.bfloat16)],
)
def test_write_triton_matches_ref(triton_kernels, device, block_size, num_kv_heads, head_dim, dtype):
    key, value, k_cache, v_cache, slots = _case(block_size, num_kv_heads, head_dim, dtype)
    key2, value2, k2, v2, slots2 = _case(block_size, num_kv_heads, head_dim, dtype, device=device)
    write_kv_cache_ref(key, value, k_cache, v_cache, slots)
    triton_kernels.kv_write.write_kv_cache_triton(key2, value2, k2, v2, slots2)
    assert k2.device.type == device.type
    assert torch.equal(k2.cpu(), k_cache) and torch.equal(v2.cpu(), v_cache)
