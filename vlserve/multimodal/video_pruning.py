"""Redundant-frame pruning of video embeddings (EVS, "Efficient Video Sampling", vLLM's `--video-pruning-rate`).

A video's tower output is a grid of merged tokens `[t * h * w, H]` (t temporal groups of h x w). At rate R the
prompt holds only `retained_token_count(h * w, t, R)` placeholders: `floor(t * h * w * (1 - R))`, never fewer than
one whole group. After the tower runs, `retention_mask` keeps the tokens that changed most from the token at the
same (h, w) in the previous temporal group (cosine dissimilarity); the first group is always kept whole. The kept
tokens keep the M-RoPE (t, h, w) positions they had in the full grid (`kept_token_indices` -> mrope.py), so the
positions of a pruned video skip, and the text after it is positioned as after the unpruned video.

Qwen3-VL lays a video out as one item per temporal group (qwen3_vl_video.py), each with text between them, so the
count of every group is fixed when the prompt is built: the first group whole, the rest of the retained count
spread evenly over the later groups (`frame_keep_counts`); each later group keeps its tokens that changed most from
the previous group, which its item carries (PREVIOUS_KEY) and the tower encodes alongside it.

The rate travels in the item's processed data (the processor puts the keys below there, the encoder runner reads
them), and it is folded into the item's mm_hash (`pruned_mm_hash`), so the encoder cache and prefix caching never
share embeddings pruned at different rates.
"""

from __future__ import annotations

import math
from typing import Any

import torch

PRUNING_KEY = "video_pruning_rate"  # in a video item's processed data: the rate its embeddings are pruned at
GRID_KEY = "video_pruning_grid"  # the merged (t, h, w) grid of the item's tower output before pruning
KEEP_KEY = "video_pruning_keep"  # how many of its embeddings the item keeps (its placeholders)
PREVIOUS_KEY = "video_pruning_previous"  # a Qwen3-VL group's: the previous group's pixel rows, compared against
_KEYS = (PRUNING_KEY, GRID_KEY, KEEP_KEY, PREVIOUS_KEY)


def check_video_pruning_rate(rate: Any, field: str = "video_pruning_rate") -> float:
    """The rate as a float in [0, 1) (None: 0.0); ValueError naming `field` otherwise."""
    if rate is None:
        return 0.0
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate):
        raise ValueError(f"{field} must be a number in [0, 1), got {rate!r}")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{field} must be in [0, 1), got {rate!r}")
    return float(rate)


def take_pruning_rate(mm_kwargs: dict | None, has_videos: bool, prunable: bool) -> tuple[float, dict]:
    """(the checked rate, the processor kwargs without it) from a request's processor kwargs; ValueError when videos
    of a family that does not prune are asked to be."""
    kwargs = dict(mm_kwargs or {})
    rate = check_video_pruning_rate(kwargs.pop(PRUNING_KEY, None))
    if rate and has_videos and not prunable:
        raise ValueError(f"{PRUNING_KEY} applies to Qwen2-VL, Qwen2.5-VL and Qwen3-VL videos, not this model's")
    return rate, kwargs


def retained_token_count(tokens_per_group: int, num_groups: int, rate: float) -> int:
    """Placeholders a video of `num_groups` temporal groups of `tokens_per_group` merged tokens keeps at `rate`:
    floor(total * (1 - rate)), at least one whole group (vLLM's rule)."""
    total = tokens_per_group * num_groups
    return max(tokens_per_group, int(total * (1.0 - rate)))


def frame_keep_counts(tokens_per_group: int, num_groups: int, rate: float) -> list[int]:
    """Per-group counts summing to `retained_token_count`: the first group whole, the rest spread evenly over the
    later groups (the earlier ones get the remainder)."""
    rest = retained_token_count(tokens_per_group, num_groups, rate) - tokens_per_group
    later = num_groups - 1
    if not later:
        return [tokens_per_group]
    return [tokens_per_group] + [rest // later + (j < rest % later) for j in range(later)]


def llm_grid(video_grid_thw: Any, merge_size: int) -> tuple[int, int, int]:
    """A processed video's `video_grid_thw` ([1, 3] or [3]) -> the merged token grid (t, h // merge, w // merge)."""
    t, h, w = (int(v) for v in torch.as_tensor(video_grid_thw).reshape(-1)[:3])
    return t, h // merge_size, w // merge_size


def pruning_rate(data: dict) -> float:
    """The rate an item's embeddings are pruned at (0.0: not pruned)."""
    return float(data.get(PRUNING_KEY, 0.0))


def pruned_mm_hash(mm_hash: str, rate: float) -> str:
    """The mm_hash of an item pruned at `rate` (the item's own hash at rate 0)."""
    return f"{mm_hash}-evs{rate!r}" if rate > 0 else mm_hash


def pruned_video_data(
    data: dict, rate: float, grid: tuple[int, int, int], keep: int | None = None, previous: Any = None
) -> dict:
    """An item's processed data marked to be pruned at `rate` (a new dict; the processor cache's stays as it is).
    A whole video keeps `retained_token_count` of its merged `grid`; a Qwen3-VL group after the first keeps `keep`
    (its `frame_keep_counts` share), chosen against `previous`, the previous group's pixel rows."""
    t, h, w = grid
    keep = retained_token_count(h * w, t, rate) if keep is None else keep
    marked = {**data, PRUNING_KEY: rate, GRID_KEY: (t, h, w), KEEP_KEY: keep}
    if previous is not None:
        marked[PREVIOUS_KEY] = previous
    return marked


def pruned_video(mm_hash: str, data: dict, rate: float, merge_size: int) -> tuple[str, dict, int]:
    """A Qwen2-VL / Qwen2.5-VL video (its mm_hash and processed data) to be pruned at `rate` -> (its mm_hash with
    the rate, its marked data, its placeholder count)."""
    data = pruned_video_data(data, rate, llm_grid(data["video_grid_thw"], merge_size))
    return pruned_mm_hash(mm_hash, rate), data, data[KEEP_KEY]


def tower_data(data: dict) -> dict:
    """What the tower reads of an item (items concatenate key by key): without the pruning keys; a Qwen3-VL group
    with a previous group gets that group's pixel rows first, as a second grid row."""
    if PRUNING_KEY not in data:
        return data
    out = {k: v for k, v in data.items() if k not in _KEYS}
    previous = data.get(PREVIOUS_KEY)
    if previous is not None:
        out["pixel_values_videos"] = torch.cat([previous, out["pixel_values_videos"]])  # [2 * rows, C*tp*p*p]
        out["video_grid_thw"] = torch.as_tensor(out["video_grid_thw"]).reshape(1, 3).repeat(2, 1)  # [2, 3]
    return out


def tower_length(data: dict, length: int) -> int:
    """Embeddings the tower produces for an item of `length` placeholders: its whole grid when pruned (twice, with
    the previous group's)."""
    if PRUNING_KEY not in data:
        return length
    t, h, w = data[GRID_KEY]
    return t * h * w * (2 if data.get(PREVIOUS_KEY) is not None else 1)


def _top(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """bool mask of the `keep` highest scores (ties: the earlier one)."""
    order = torch.argsort(scores, descending=True, stable=True)
    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask[order[:keep]] = True
    return mask


def _change(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """1 - cosine similarity of matching rows, float32 (the last dim compared)."""
    return 1.0 - torch.nn.functional.cosine_similarity(current.float(), previous.float(), dim=-1)


def retention_mask(embeds: torch.Tensor, grid: tuple[int, int, int], rate: float) -> torch.Tensor:
    """Which merged tokens of one video to keep -> bool `[t * h * w]`, exactly `retained_token_count(h*w, t, rate)`
    of them True.

    embeds: `[t * h * w, D]` in (t, h, w) order (D: the features compared; DeepStack levels excluded by the caller);
    grid: the merged (t, h, w). Score per token: 1 - cosine(token, same (h, w) one group earlier); the first group
    scores above any dissimilarity (max 2) so it is always kept; ties keep the earlier token.
    """
    t, h, w = grid
    per_group = h * w
    if embeds.shape[0] != t * per_group:
        raise ValueError(f"{embeds.shape[0]} video embeddings do not fill a grid of {t} x {h} x {w}")
    frames = embeds.reshape(t, per_group, -1)  # [t, h*w, D]
    change = _change(frames[1:], frames[:-1])  # [t-1, h*w]
    first = torch.full((1, per_group), 3.0, dtype=change.dtype, device=change.device)  # [1, h*w]
    return _top(torch.cat([first, change], dim=0).reshape(-1), retained_token_count(per_group, t, rate))


def frame_retention_mask(frame: torch.Tensor, previous: torch.Tensor, keep: int) -> torch.Tensor:
    """bool `[n]`: the `keep` tokens of one group `[n, D]` that changed most from the previous group `[n, D]`."""
    return _top(_change(frame, previous), keep)


def kept_token_indices(mask: torch.Tensor) -> torch.Tensor:
    """Indices (int64 `[n]`, ascending: the kept tokens' order in the prompt) of the True entries of a mask."""
    return torch.nonzero(mask, as_tuple=False).reshape(-1).to(torch.long)


def prune_video_embeds(
    embeds: torch.Tensor, data: dict, compared_width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept rows `[keep, W]`, their indices in the item's grid `[keep]` on the CPU) of the tower's output for an
    item marked for pruning (`[tower_length, W]`). `compared_width`: only the first columns decide (Qwen3-VL: the
    main embedding, not its DeepStack levels, which go with their token)."""
    compared = embeds if compared_width is None else embeds[:, :compared_width]  # [tower_length, D]
    if data.get(PREVIOUS_KEY) is not None:  # [previous group; this group]
        n = embeds.shape[0] // 2
        mask = frame_retention_mask(compared[n:], compared[:n], int(data[KEEP_KEY]))  # [n]
        embeds = embeds[n:]
    else:
        mask = retention_mask(compared, data[GRID_KEY], pruning_rate(data))  # [t*h*w]
    return embeds[mask], kept_token_indices(mask).cpu()
