"""Which media items a scheduled token window needs encoded or reused, within the step's encoder budget and the
encoder cache (pure Python; the scheduler's helper)."""
from __future__ import annotations

from dataclasses import dataclass, field

from vlserve.core.encoder_cache_manager import EncoderCacheManager


@dataclass
class EncoderPlan:
    """The media items a planned token window needs: cached ones it reuses (mm_hashes) and ones to encode (item
    indices into the request's mm_features)."""

    reuse: list[str] = field(default_factory=list)
    to_encode: list[int] = field(default_factory=list)


NO_MEDIA = EncoderPlan()  # the plan of every window without media (only read, never filled)


def plan_encoder_inputs(features, cache: EncoderCacheManager, encoder_budget: int, start: int, num_new: int,
                        num_encoding: int, keep_whole: bool = False) -> tuple[EncoderPlan, int, int]:
    """Plan (without side effects) the media items the token window [start, start + num_new) reaches: the cached
    ones it reuses and the ones it must encode. `num_encoding`: embeddings the step already encodes. An item
    that cannot be afforded cuts the window to the text before it: one that does not fit the cache, or that
    would take the step past `encoder_budget` (unless it is the step's first, which runs alone if need be).
    Returns (plan, num_new, num_encoding with this plan's items). `keep_whole`: never end the window inside an
    item (`_keep_items_whole`)."""
    if not features or num_new <= 0:
        return NO_MEDIA, num_new, num_encoding
    if keep_whole:
        num_new = _keep_items_whole(features, start, num_new)
        if num_new <= 0:
            return NO_MEDIA, num_new, num_encoding
    plan = EncoderPlan()
    pending = 0
    for i, f in enumerate(features):
        if f.offset >= start + num_new:
            break
        if f.end <= start:
            continue  # its KV is already written
        if cache.has(f.mm_hash):
            if not cache.can_allocate(0, None, pending, reuse=[*plan.reuse, f.mm_hash]):
                num_new = f.offset - start  # keeping it would leave no room for the items before it
                break
            plan.reuse.append(f.mm_hash)
            continue
        if any(features[j].mm_hash == f.mm_hash for j in plan.to_encode):
            continue  # the same item twice in one prompt: encoded once
        over_budget = num_encoding > 0 and num_encoding + f.length > encoder_budget
        if over_budget or not cache.can_allocate(f.length, None, pending, reuse=plan.reuse):
            num_new = f.offset - start
            break
        plan.to_encode.append(i)
        pending += f.length
        num_encoding += f.length
    return plan, num_new, num_encoding


def _keep_items_whole(features, start: int, num_new: int) -> int:
    """The window [start, start + num_new) shortened so it ends at no item's inside: cut back to the start of the
    item it would split, or 0 (wait for a bigger budget) when the window starts inside that item."""
    end = start + num_new
    for f in features:
        if f.offset < end < f.end:
            return f.offset - start if f.offset > start else 0
    return num_new
