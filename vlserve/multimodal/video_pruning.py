"""Redundant-frame pruning of video embeddings (EVS, "Efficient Video Sampling", vLLM's `--video-pruning-rate`).

A video's tower output is a grid of merged tokens `[t * h * w, H]` (t temporal groups of h x w). At rate R the
prompt holds only `retained_token_count(h * w, t, R)` placeholders: `floor(t * h * w * (1 - R))`, never fewer than
one whole group. After the tower runs, `retention_mask` keeps the tokens that changed most from the token at the
same (h, w) in the previous temporal group (cosine dissimilarity); the first group is always kept whole. The kept
tokens keep the M-RoPE (t, h, w) positions they had in the full grid (`kept_token_indices` -> mrope.py), so the
positions of a pruned video skip, and the text after it is positioned as after the unpruned video.

The rate travels in the item's processed data under PRUNING_KEY (the processor puts it there, the encoder runner
reads it), and it is folded into the item's mm_hash (`pruned_mm_hash`), so the encoder cache and prefix caching
never share embeddings pruned at different rates.
"""

from __future__ import annotations

import math
from typing import Any

import torch

PRUNING_KEY = "video_pruning_rate"  # in a video item's processed data: the rate its embeddings are pruned at
GRID_KEY = "video_pruning_grid"  # beside it: the merged (t, h, w) grid the tower fills before pruning


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
    that cannot be pruned (not one Qwen2-VL-style grid per video) are asked to be."""
    kwargs = dict(mm_kwargs or {})
    rate = check_video_pruning_rate(kwargs.pop(PRUNING_KEY, None))
    if rate and has_videos and not prunable:
        raise ValueError(
            f"{PRUNING_KEY} applies to Qwen2-VL / Qwen2.5-VL videos; this model's videos are laid out otherwise"
        )
    return rate, kwargs


def retained_token_count(tokens_per_group: int, num_groups: int, rate: float) -> int:
    """Placeholders a video of `num_groups` temporal groups of `tokens_per_group` merged tokens keeps at `rate`:
    floor(total * (1 - rate)), at least one whole group (vLLM's rule)."""
    total = tokens_per_group * num_groups
    return max(tokens_per_group, int(total * (1.0 - rate)))


def llm_grid(video_grid_thw: Any, merge_size: int) -> tuple[int, int, int]:
    """A processed video's `video_grid_thw` ([1, 3] or [3]) -> the merged token grid (t, h // merge, w // merge)."""
    t, h, w = (int(v) for v in torch.as_tensor(video_grid_thw).reshape(-1)[:3])
    return t, h // merge_size, w // merge_size


def pruning_rate(data: dict) -> float:
    """The rate an item's embeddings are pruned at (0.0: not pruned)."""
    return float(data.get(PRUNING_KEY, 0.0))


def pruned_video_data(data: dict, rate: float, grid: tuple[int, int, int]) -> dict:
    """A video's processed data marked to be pruned at `rate` (a new dict; the processor cache's stays as it is)."""
    return {**data, PRUNING_KEY: rate, GRID_KEY: tuple(grid)}


def tower_data(data: dict) -> dict:
    """The item's processed data without the pruning keys (what the tower reads; items concatenate key by key)."""
    return {k: v for k, v in data.items() if k not in (PRUNING_KEY, GRID_KEY)} if PRUNING_KEY in data else data


def tower_length(data: dict, length: int) -> int:
    """Embeddings the tower produces for an item of `length` placeholders: its whole grid when pruned."""
    if PRUNING_KEY not in data:
        return length
    t, h, w = data[GRID_KEY]
    return t * h * w


def pruned_mm_hash(mm_hash: str, rate: float) -> str:
    """The mm_hash of an item pruned at `rate` (the item's own hash at rate 0)."""
    return f"{mm_hash}-evs{rate!r}" if rate > 0 else mm_hash


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
    frames = embeds.float().reshape(t, per_group, -1)  # [t, h*w, D]
    change = 1.0 - torch.nn.functional.cosine_similarity(frames[1:], frames[:-1], dim=-1)  # [t-1, h*w]
    first = torch.full((1, per_group), 3.0, dtype=change.dtype, device=change.device)  # [1, h*w]
    scores = torch.cat([first, change], dim=0).reshape(-1)  # [t*h*w]
    order = torch.argsort(scores, descending=True, stable=True)  # [t*h*w]
    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask[order[: retained_token_count(per_group, t, rate)]] = True
    return mask


def kept_token_indices(mask: torch.Tensor) -> torch.Tensor:
    """Indices (int64 `[n]`, ascending: the kept tokens' order in the prompt) of the True entries of a mask."""
    return torch.nonzero(mask, as_tuple=False).reshape(-1).to(torch.long)


def prune_video_embeds(
    embeds: torch.Tensor, grid: tuple[int, int, int], rate: float, compared_width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept rows `[n, W]`, their indices in the full grid `[n]` on the CPU) of one video's embeddings `[t*h*w, W]`.
    `compared_width`: only the first columns decide the mask (Qwen3-VL: the main embedding, not its DeepStack
    levels, which are kept or dropped with their token)."""
    compared = embeds if compared_width is None else embeds[:, :compared_width]  # [t*h*w, D]
    mask = retention_mask(compared, grid, rate)  # [t*h*w]
    return embeds[mask], kept_token_indices(mask).cpu()
