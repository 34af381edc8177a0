"""Which media items a scheduled token window needs encoded or reused, within the step's encoder budget and the
encoder cache, and the cache entries a scheduled plan takes (pure Python; the scheduler's helpers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlserve.core.encoder_cache_manager import EncoderCacheManager
from vlserve.core.sched_output import EncoderSlice


@dataclass
class EncoderPlan:
    """The media items a planned token window needs: cached ones it reuses (mm_hashes), ones to encode whole (item
    indices into the request's mm_features) and slices of items encoded over several steps."""

    reuse: list[str] = field(default_factory=list)
    to_encode: list[int] = field(default_factory=list)
    slices: list[EncoderSlice] = field(default_factory=list)

    def reads_remote_media(self, features) -> bool:
        """Whether it encodes (whole or a slice of) an item whose media stayed with a disaggregated producer."""
        if not self.to_encode and not self.slices:  # (every text-only admission asks)
            return False
        return any(
            features[i].data.get("remote_media") for i in (*self.to_encode, *(s.item_index for s in self.slices))
        )


NO_MEDIA = EncoderPlan()  # the plan of every window without media (only read, never filled)
SLICES_PER_ITEM = 3  # a lone slice takes at least this share of an item's stages (within the slice cap)


def plan_encoder_inputs(
    features,
    cache: EncoderCacheManager,
    encoder_budget: int,
    start: int,
    num_new: int,
    num_encoding: int,
    keep_whole: bool = False,
    stage_counts: dict[str, int] | None = None,
    request_id: str | None = None,
    slice_cap: int = 0,
    pack_budget: int | None = None,
) -> tuple[EncoderPlan, int, int]:
    """Plan (without side effects) the media items the token window [start, start + num_new) reaches: the cached
    ones it reuses and the ones it must encode. `num_encoding`: embeddings the step already encodes. An item
    that cannot be afforded cuts the window to the text before it: one that does not fit the cache, or that
    would take the step past `encoder_budget` (unless it is the step's first, which runs alone if need be).
    Returns (plan, num_new, num_encoding with this plan's items). `keep_whole`: never end the window inside an
    item (`_keep_items_whole`).

    Split encoding (`stage_counts`: per modality, the stages its tower splits into; `request_id` the planning
    request): an item over the whole budget runs a slice of its stages instead (the stages what is left of the
    budget affords, at least one when the step encodes nothing else; a stage costs length / stages embeddings) and
    the window stops before it until its last slice, which may share the step with the item's tokens. An item that
    fits a step's budget but not what is left of it waits for the next step and is encoded whole there: slicing it
    would finish it a step later (a later first token); the step leaves the rest of its budget unused. A partial
    item is advanced only by a request referencing it; any other request waits before it. A slice the step runs
    alone takes at least 1 / SLICES_PER_ITEM of the item's stages, as far as `slice_cap` embeddings (about a second
    of tower work, `EncoderBudget.slice_cap`; 0: no such floor) pay for: an item far over a short budget is then
    encoded in a few steps rather than one stage a step, each of which also carries a decode step. `pack_budget`
    (default `encoder_budget`): a whole item joins a step that already encodes only while the step stays within it;
    one that fits the budget but not that waits for a step of its own."""
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
        if any(s.mm_hash == f.mm_hash for s in plan.slices):
            continue  # the same item twice in one prompt: its slice finishes it in this step (else the window ended)
        done = cache.partial.get(f.mm_hash)
        if done is not None:  # encoded a slice per step: only one of its referencing requests advances it
            stages = stage_counts.get(f.modality, 1) if stage_counts else 1
            if request_id not in cache.cached[f.mm_hash] or stages <= done:
                num_new = f.offset - start
                break
            piece = _affordable_slice(f, i, done, stages, encoder_budget - num_encoding, num_encoding == 0, slice_cap)
            if piece is None:
                num_new = f.offset - start
                break
            plan.slices.append(piece)
            num_encoding += _slice_cost(f.length, piece)
            if piece.end < stages:
                num_new = f.offset - start
                break
            continue
        if cache.has(f.mm_hash):
            if not cache.can_allocate(0, None, pending, reuse=[*plan.reuse, f.mm_hash]):
                num_new = f.offset - start  # keeping it would leave no room for the items before it
                break
            plan.reuse.append(f.mm_hash)
            continue
        if any(features[j].mm_hash == f.mm_hash for j in plan.to_encode):
            continue  # the same item twice in one prompt: encoded once
        limit = encoder_budget if num_encoding == 0 or pack_budget is None else min(encoder_budget, pack_budget)
        fits = num_encoding + f.length <= limit
        stages = stage_counts.get(f.modality, 1) if stage_counts else 1
        whole_next_step = num_encoding > 0 and f.length <= encoder_budget  # it fits a step of its own: wait for one
        if (
            not fits
            and stages > 1
            and not whole_next_step
            and cache.can_allocate(f.length, None, pending, reuse=plan.reuse)
        ):
            piece = _affordable_slice(f, i, 0, stages, encoder_budget - num_encoding, num_encoding == 0, slice_cap)
            if piece is not None:
                plan.slices.append(piece)
                pending += f.length
                num_encoding += _slice_cost(f.length, piece)
            num_new = f.offset - start
            break
        over_budget = num_encoding > 0 and not fits
        if over_budget or not cache.can_allocate(f.length, None, pending, reuse=plan.reuse):
            num_new = f.offset - start
            break
        plan.to_encode.append(i)
        pending += f.length
        num_encoding += f.length
    return plan, num_new, num_encoding


def _affordable_slice(
    f, item_index: int, done: int, stages: int, budget_left: int, alone: bool, slice_cap: int = 0
) -> EncoderSlice | None:
    """The stages [done, end) of item f that `budget_left` embeddings pay for (when `alone`, the step encoding
    nothing else: at least one, and at least stages / SLICES_PER_ITEM as far as `slice_cap` embeddings pay for),
    or None when not even one fits."""
    end = min(stages, done + max(budget_left, 0) * stages // f.length)
    if alone:
        floor = min(-(-stages // SLICES_PER_ITEM), slice_cap * stages // f.length)
        end = min(stages, max(end, done + 1, done + floor))
    return EncoderSlice(f.mm_hash, item_index, done, end, stages) if end > done else None


def _slice_cost(length: int, piece: EncoderSlice) -> int:
    """Embeddings' worth of encoder work in a slice: length x its share of the stages (rounded up)."""
    return -(-length * (piece.end - piece.start) // piece.num_stages)


def _keep_items_whole(features, start: int, num_new: int) -> int:
    """The window [start, start + num_new) shortened so it ends at no item's inside: cut back to the start of the
    item it would split, or 0 (wait for a bigger budget) when the window starts inside that item."""
    end = start + num_new
    for f in features:
        if f.offset < end < f.end:
            return f.offset - start if f.offset > start else 0
    return num_new


def commit_encoder_inputs(
    cache: EncoderCacheManager,
    req,
    plan: EncoderPlan,
    out: dict[str, list[int]],
    out_slices: dict[str, list[EncoderSlice]],
) -> None:
    """Carry out a scheduled request's plan in the encoder cache: reference the reused items, then allocate (evicting
    as needed) the ones to encode, whole or in slices (a split item's entry is allocated at its first slice and
    partial until its last); record them in the step's `out` (item indices) and `out_slices` by request id."""
    if not plan.reuse and not plan.to_encode and not plan.slices:
        return
    modality_of = {f.mm_hash: f.modality for f in req.mm_features}
    for mm_hash in plan.reuse:
        cache.check_and_update_cache(req.request_id, mm_hash, modality_of[mm_hash])
    for i in plan.to_encode:
        f = req.mm_features[i]
        cache.allocate(req.request_id, f.mm_hash, f.length, f.modality)
    if plan.to_encode:
        out[req.request_id] = plan.to_encode
    for piece in plan.slices:
        if piece.start == 0:
            f = req.mm_features[piece.item_index]
            cache.allocate(req.request_id, f.mm_hash, f.length, f.modality)
        cache.advance_partial(piece.mm_hash, piece.end, piece.num_stages)
    if plan.slices:
        out_slices[req.request_id] = plan.slices
