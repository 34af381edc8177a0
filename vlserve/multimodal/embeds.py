"""Placing encoder outputs into a step: which rows of which item embeddings a (chunked) prefill window needs, and
writing them over the placeholder tokens' embeddings. The runner's one merge path."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from vlserve.multimodal.inputs import MultiModalFeature


def slice_mm_embeds(
    features: list[MultiModalFeature],
    encoder_outputs: Mapping[str, Any],
    start: int,
    end: int,
    step_offset: int = 0,
    skip_missing: bool = False,
) -> list[tuple[int, Any]]:
    """For the window [start, end) of one request, return [(row in the flattened step, embeddings [n, H])]
    covering every placeholder token in the window, ready for `merge_mm_embeds`.

    `encoder_outputs` maps mm_hash -> that item's full embeddings [length, H]; `step_offset` is where this
    request's tokens begin in the flattened step. A KeyError names an item whose embeddings are missing, unless
    `skip_missing` (then that item's tokens keep their token embeddings).
    """
    out: list[tuple[int, Any]] = []
    for f in features:
        lo, hi = max(f.offset, start), min(f.end, end)
        if lo >= hi:
            continue
        if f.mm_hash not in encoder_outputs:
            if skip_missing:
                continue
            raise KeyError(
                f"encoder output for {f.modality} item {f.mm_hash[:16]} (tokens [{f.offset}, {f.end})) "
                f"is not cached but the step covers tokens [{start}, {end})"
            )
        emb = encoder_outputs[f.mm_hash]
        out.append((step_offset + lo - start, emb[lo - f.offset : hi - f.offset]))
    return out


def merge_mm_embeds(embeds: torch.Tensor, pieces: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """In place: each `(row, emb [n, H])` overwrites rows [row, row + n) of the token embeddings `embeds [T, H]`.
    Returns `embeds`. A ValueError names a piece that falls outside the step."""
    for row, emb in pieces:
        n = emb.shape[0]
        if row < 0 or row + n > embeds.shape[0]:
            raise ValueError(
                f"multimodal embeddings [{row}, {row + n}) fall outside the {embeds.shape[0]} tokens of the step"
            )
        embeds[row : row + n] = emb.to(device=embeds.device, dtype=embeds.dtype)
    return embeds
