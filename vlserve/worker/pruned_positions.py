"""M-RoPE positions of pruned videos (vlserve.multimodal.video_pruning): which grid positions a pruned video's
placeholders take is known only once its tower ran. A request's positions are built with provisional ones for them;
after the step's encoders run, `place_pruned_positions` rebuilds the positions of each request whose pruned items
now have their kept grid indices held by the encoder runner, before the step reads any of those positions (the
scheduler runs an item's encoder no later than the first step that computes one of its tokens)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from vlserve.multimodal.video_pruning import pruning_rate


def pruned_items(mm_features) -> set[str]:
    """mm_hashes of a request's pruned videos (their positions still provisional)."""
    return {f.mm_hash for f in mm_features if f.modality == "video" and pruning_rate(f.data)}


def place_pruned_positions(states: Iterable, encoders, mrope_positions_fn: Callable) -> None:
    """For each request state with pruned items not placed yet: take the kept grid indices the encoder runner now
    holds (`encoders.kept_indices(mm_hash)`) and rebuild `state.mrope_positions` with them. The text after an item
    keeps its positions (and the request its mrope_delta): only the pruned items' own tokens move."""
    for state in states:
        if not state.unplaced_pruned:  # (nearly every request: no pruned video, or placed already)
            continue
        found = {h: kept for h in state.unplaced_pruned if (kept := encoders.kept_indices(h)) is not None}
        if not found:
            continue
        state.kept_indices.update(found)
        state.unplaced_pruned.difference_update(found)
        state.mrope_positions, _ = mrope_positions_fn(
            state.prompt_token_ids, state.mm_features, kept_indices=state.kept_indices
        )
