"""Unpacking the integer weights and zero points that the checkpoint formats store several to an int32 word."""

from __future__ import annotations

import torch

# AWQ's GEMM packing puts element `AWQ_ORDER[i]` of each group of eight in nibble i of the word.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(
    packed: torch.Tensor, bits: int, dim: int, size: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """int32 words -> uint8 values, unpacked along `dim` and cut to `size` there.

    Word w holds `32 / bits` consecutive elements along `dim`, element i of them in bits `[bits * i, bits * (i + 1))`
    (the order of compressed-tensors and GPTQ); with `order`, nibble i holds element `order[i]` instead (AWQ)."""
    per_word = 32 // bits
    moved = packed.movedim(dim, -1).to(torch.int32)  # [..., W]
    shifts = torch.arange(per_word, dtype=torch.int32, device=packed.device) * bits  # [P]
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., W, P]: value of nibble i
    if order is not None:
        inverse = [0] * per_word
        for slot, element in enumerate(order):
            inverse[element] = slot
        values = values[..., inverse]  # [..., W, P]: element j
    values = values.reshape(*moved.shape[:-1], -1)[..., :size]  # [..., size]
    return values.to(torch.uint8).movedim(-1, dim).contiguous()


def pack_int32(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """uint8 values (< 2^bits) -> int32 words along `dim`, the inverse of `unpack_int32` (zero-padded)."""
    per_word = 32 // bits
    moved = values.movedim(dim, -1).to(torch.int64)  # [..., S]
    pad = (-moved.shape[-1]) % per_word
    if pad:
        moved = torch.nn.functional.pad(moved, (0, pad))
    groups = moved.reshape(*moved.shape[:-1], -1, per_word)  # [..., W, P]: element j
    if order is not None:
        groups = groups[..., list(order)]  # nibble i holds element order[i]
    shifts = torch.arange(per_word, dtype=torch.int64, device=values.device) * bits
    words = (groups << shifts).sum(dim=-1)  # [..., W] in [0, 2^32)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()
