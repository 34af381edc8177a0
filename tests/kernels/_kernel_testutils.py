"""Shared builders, plain loop-style references and device-aware tolerances for the kernel tests.

Cases are built on the CPU (seeded generators give the same numbers everywhere) and the references
are computed there; only the kernel under test sees tensors moved to the test device.
"""

from __future__ import annotations

import dataclasses

import torch

from vlserve.kernels.metadata import AttentionMetadata


def make_paged_kv(
    contexts: list[tuple[torch.Tensor, torch.Tensor]],
    block_size: int,
    extra_blocks: int = 3,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter contiguous per-sequence K/V ([S_b, Hkv, D]) into shuffled cache blocks, one slot at a time.

    Unused slots hold large finite garbage so that any leak past seq_len shows up in the output.
    Returns k_cache, v_cache [NB, BS, Hkv, D] and block_tables [B, M] int32 (unused entries 0).
    """
    num_kv_heads, head_dim = contexts[0][0].shape[1:]
    dtype = contexts[0][0].dtype
    blocks_per_seq = [max(1, -(-k.shape[0] // block_size)) for k, _ in contexts]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    max_blocks = max(blocks_per_seq) + 1
    k_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator) * 50).to(dtype)
    v_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator) * 50).to(dtype)
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.zeros(len(contexts), max_blocks, dtype=torch.int32)
    for b, (k, v) in enumerate(contexts):
        ids = [perm.pop() for _ in range(blocks_per_seq[b])]
        block_tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for p in range(k.shape[0]):
            k_cache[ids[p // block_size], p % block_size] = k[p]
            v_cache[ids[p // block_size], p % block_size] = v[p]
    return k_cache, v_cache, block_tables


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: list[int], scale: float
) -> torch.Tensor:
    """Plain float64 attention: query i (at q_positions[i]) sees keys 0..q_positions[i]; GQA by head // group."""
    # q: [n, Hq, D]; k, v: [S, Hkv, D] contiguous; returns [n, Hq, D] in q.dtype
    num_q_heads = q.shape[1]
    group = num_q_heads // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, pos in enumerate(q_positions):
        for h in range(num_q_heads):
            kh = k[: pos + 1, h // group].double()  # [pos+1, D]
            vh = v[: pos + 1, h // group].double()
            scores = (kh @ q[i, h].double()) * scale  # [pos+1]
            weights = torch.exp(scores - scores.max())
            weights = weights / weights.sum()
            out[i, h] = weights @ vh
    return out.to(q.dtype)


def build_metadata(
    q_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    block_size: int,
    num_decodes: int,
    num_padding_tokens: int = 0,
) -> AttentionMetadata:
    """AttentionMetadata for sequences whose new tokens are the last q_len of seq_len positions."""
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    slots = []
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        for p in range(seq_len - q_len, seq_len):
            slots.append(int(block_tables[b, p // block_size]) * block_size + p % block_size)
    slots += [-1] * num_padding_tokens
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        num_decodes=num_decodes,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
    )


def poison_unused_slots(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int]
) -> None:
    """Fill every cache slot that holds no live token with NaN (what torch.empty may leave behind)."""
    block_size = k_cache.shape[1]
    live = torch.zeros(k_cache.shape[0] * block_size, dtype=torch.bool)
    for b, n in enumerate(seq_lens):
        for p in range(n):
            live[int(block_tables[b, p // block_size]) * block_size + p % block_size] = True
    k_cache.view(-1, *k_cache.shape[2:])[~live] = float("nan")
    v_cache.view(-1, *v_cache.shape[2:])[~live] = float("nan")


def to_device(device: torch.device | str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Copies of `tensors` on `device` (new storage even when already there, so in-place kernels stay apart)."""
    return tuple(t.to(device, copy=True) for t in tensors)


def metadata_to(md: AttentionMetadata, device: torch.device | str) -> AttentionMetadata:
    """`md` with its tensor fields moved to `device`."""
    moved = {
        f.name: getattr(md, f.name).to(device)
        for f in dataclasses.fields(md)
        if isinstance(getattr(md, f.name), torch.Tensor)
    }
    # what the kernels derived on md's device (int64 slots, gather plans) is not carried over
    return dataclasses.replace(md, **moved, derived={})


def kernel_tol(device: torch.device | str, dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances for a kernel's output against a CPU reference.

    Half types: 2e-2 everywhere. float32: 2e-5 / 1e-5 on CPU (the interpreter runs numpy float32);
    on CUDA 1e-4 / 1e-4, for the GPU's approximate exp2 and its different summation order. A masking or
    paging bug is off by O(1) (unused cache slots hold values of size ~50), far above either.
    """
    if dtype in (torch.bfloat16, torch.float16):
        return dict(atol=2e-2, rtol=2e-2)
    if torch.device(device).type == "cuda":
        return dict(atol=1e-4, rtol=1e-4)
    return dict(atol=2e-5, rtol=1e-5)
