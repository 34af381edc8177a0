"""Varlen attention on the torch path: segments of contiguous rows that attend only to themselves (block-diagonal,
optionally causal), as vision, audio and text towers need; no KV cache. Short segments on CPU go through one C++
call (varlen_attention_cpu), the others through SDPA, segments of one length batched into one call."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlserve.kernels.varlen_attention_cpu import max_segment_len, segment_attention_cpu, segment_kernel_takes


def varlen_attention_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    max_seqlen: int | None = None,
    cu_seqlens_cpu: list[int] | None = None,
    out: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Varlen attention over contiguous K/V: segment b (rows cu_seqlens[b]..cu_seqlens[b+1]) attends only to itself
    (a block-diagonal mask; `causal`: row i of a segment to its rows 0..i). Rows past cu_seqlens[-1] come out zero.
    On CPU the short segments go through one C++ call (varlen_attention_cpu), the rest through SDPA."""
    # query: [T, Hq, D]; key, value: [T, Hkv, D]; cu_seqlens: [B+1] int32; returns [T, Hq, D]
    del max_seqlen  # only the Triton grid needs it
    bounds = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.tolist()
    if out is None:
        out = torch.zeros_like(query)
    gqa = query.shape[1] != key.shape[1]
    segments = [(start, end - start) for start, end in zip(bounds[:-1], bounds[1:]) if end > start]
    if segments and segment_kernel_takes(query, key, value, out):
        limit = max_segment_len(causal, query.dtype, query.shape[2])
        short = [seg for seg in segments if seg[1] <= limit]
        segments = [seg for seg in segments if seg[1] > limit]
        segment_attention_cpu(query, key, value, [s for s, _ in short], [n for _, n in short], scale, causal, out)
    # Segments of equal length share one batched SDPA call (Qwen2.5-VL windows are mostly the same size).
    starts_by_len: dict[int, list[int]] = {}
    for start, length in segments:
        starts_by_len.setdefault(length, []).append(start)
    for length, starts in starts_by_len.items():
        if len(starts) == 1:
            rows: slice | torch.Tensor = slice(starts[0], starts[0] + length)
            q, k, v = (t[rows].transpose(0, 1).unsqueeze(0) for t in (query, key, value))  # [1, H, L, D]
        else:
            first = torch.tensor(starts, dtype=torch.long, device=query.device)  # [n]
            rows = first[:, None] + torch.arange(length, device=query.device)  # [n, L]
            q, k, v = (t[rows].transpose(1, 2) for t in (query, key, value))  # [n, H, L, D]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)  # [n, Hq, L, D]
        o = o.transpose(1, 2)  # [n, L, Hq, D]
        out[rows] = o[0] if isinstance(rows, slice) else o
    return out
