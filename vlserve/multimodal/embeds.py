"""Placing encoder outputs into a step: which rows of which item embeddings a (chunked) prefill window needs."""
from __future__ import annotations

from typing import Any, Mapping

from vlserve.multimodal.inputs import MultiModalFeature


def slice_mm_embeds(features: list[MultiModalFeature], encoder_outputs: Mapping[str, Any], start: int, end: int,
                    step_offset: int = 0) -> list[tuple[int, Any]]:
    """For the prompt window [start, end) of one request, return [(row in the flattened step, embeddings [n, H])]
    covering every placeholder token in the window, ready for `model.get_input_embeddings(ids, mm_embeds)`.

    `encoder_outputs` maps mm_hash -> that item's full embeddings [length, H]; `step_offset` is where this
    request's tokens begin in the flattened step. A KeyError names an item whose embeddings are missing.
    """
    out: list[tuple[int, Any]] = []
    for f in features:
        lo, hi = max(f.offset, start), min(f.end, end)
        if lo >= hi:
            continue
        if f.mm_hash not in encoder_outputs:
            raise KeyError(f"encoder output for {f.modality} item {f.mm_hash[:16]} (tokens [{f.offset}, {f.end})) "
                           f"is not cached but the step covers tokens [{start}, {end})")
        emb = encoder_outputs[f.mm_hash]
        out.append((step_offset + lo - start, emb[lo - f.offset:hi - f.offset]))
    return out
