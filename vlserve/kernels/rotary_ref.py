"""Torch implementation of NeoX / HF-Llama rotary embedding, with Qwen2-VL M-RoPE.

The arithmetic mirrors HF transformers exactly: cos/sin are taken from float caches, cast to the
query dtype, and the rotation is evaluated as separate multiply / add ops in that dtype, so the
result is bit-identical to `q * cos + rotate_half(q) * sin`.
"""

from __future__ import annotations

import torch


def build_rotary_cache(
    inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin caches [P, R/2] computed exactly as HF rotary embeddings compute them."""
    # inv_freq: [R/2] (HF `rotary_emb.inv_freq`); HF takes cos(position * inv_freq) in float32
    positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = positions[:, None] * inv_freq.float()[None, :]  # [P, R/2]
    return freqs.cos() * attention_scaling, freqs.sin() * attention_scaling


def mrope_frequency_axes(
    mrope_section: list[int], device: torch.device | None = None, interleaved: bool = False
) -> torch.Tensor:
    """Axis (0=t, 1=h, 2=w) that each of the R/2 frequencies takes its position from: contiguous sections
    (Qwen2-VL), or interleaved t, h, w, t, h, w, ... with h and w taking every third frequency from 1 and 2 for
    section[1] and section[2] turns, the rest t (Qwen3-VL)."""
    # returns: [R/2] int64, R/2 == sum(mrope_section)
    if not interleaved:
        axes = [axis for axis, n in enumerate(mrope_section) for _ in range(n)]
        return torch.tensor(axes, dtype=torch.long, device=device)
    axes = torch.zeros(sum(mrope_section), dtype=torch.long)
    for axis in (1, 2):
        axes[axis : 3 * mrope_section[axis] : 3] = axis
    return axes.to(device)


def rotary_cos_sin(
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    mrope_section: list[int] | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token half-width cos/sin tables, [T, R/2] each, in the cache dtype (`interleaved`: see
    `mrope_frequency_axes`)."""
    # positions: [T] or [3, T] int64; cos_cache, sin_cache: [P, R/2]
    half = cos_cache.shape[-1]
    if positions.dim() == 1:
        pos = positions.to(torch.long)
        return cos_cache.index_select(0, pos), sin_cache.index_select(0, pos)
    if positions.dim() != 2:
        raise ValueError(f"positions must be [T] or [3, T], got shape {tuple(positions.shape)}")
    if mrope_section is None:
        raise ValueError("positions of shape [3, T] need mrope_section")
    if sum(mrope_section) != half:
        raise ValueError(f"sum(mrope_section)={sum(mrope_section)} must equal rotary_dim/2={half}")
    axes = mrope_frequency_axes(mrope_section, positions.device, interleaved)  # [R/2]
    pos = positions.to(torch.long)[axes].t()  # [T, R/2]: position of token t for frequency j
    freq = torch.arange(half, device=positions.device)  # [R/2]
    return cos_cache[pos, freq], sin_cache[pos, freq]


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    # x: [T, H, D]; cos, sin: [T, 1, R/2] in x.dtype
    half = cos.shape[-1]
    x1 = x[..., :half]
    x2 = x[..., half : 2 * half]
    # HF: x * cat(cos, cos) + cat(-x2, x1) * cat(sin, sin), evaluated op by op in x.dtype.
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    x1.copy_(o1)
    x2.copy_(o2)


def apply_rotary_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    mrope_section: list[int] | None = None,
) -> None:
    """Rotate the first R dims of query and key in place (NeoX halves; M-RoPE if positions is [3, T])."""
    # query: [T, Hq, D]; key: [T, Hkv, D]; positions: [T] or [3, T]; cos/sin_cache: [P, R/2]
    if query.shape[0] == 0:
        return
    cos, sin = rotary_cos_sin(positions, cos_cache, sin_cache, mrope_section)  # [T, R/2]
    cos_q = cos.to(query.dtype).unsqueeze(1)  # [T, 1, R/2]
    sin_q = sin.to(query.dtype).unsqueeze(1)
    _rotate_(query, cos_q, sin_q)
    if key.dtype != query.dtype:
        cos_q = cos.to(key.dtype).unsqueeze(1)
        sin_q = sin.to(key.dtype).unsqueeze(1)
    _rotate_(key, cos_q, sin_q)


def apply_rotary_float32_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    mrope_section: list[int] | None = None,
    rotate=None,
) -> None:
    """`rotate` (default `apply_rotary_ref`) on float32 copies of query and key, written back in their dtypes (HF's
    vision towers rotate q and k in float32 whatever the model's dtype)."""
    # query: [T, Hq, D]; key: [T, Hkv, D]
    q32, k32 = query.float(), key.float()
    (rotate or apply_rotary_ref)(q32, k32, positions, cos_cache.float(), sin_cache.float(), mrope_section)
    query.copy_(q32)
    key.copy_(k32)
