"""Qwen2-VL / Qwen2.5-VL multimodal rotary positions (M-RoPE): three position ids (temporal, height, width) per token.

Text tokens get equal ids on all three axes, continuing from the previous maximum + 1. The placeholder tokens of an
item with LLM grid (t, h, w) = (grid_t, grid_h // merge, grid_w // merge) get (t_idx, h_idx, w_idx) + offset, where
the offset is (text ids so far). For Qwen2.5-VL videos, t_idx = t * int(second_per_grid_t) * tokens_per_second,
truncating second_per_grid_t to an integer exactly as transformers 4.57's get_rope_index does
(pass `truncate_second_per_grid=False` for the float behaviour of the original Qwen code / vLLM).

After the prompt, every token at sequence index p has position p + mrope_position_delta on all three axes.

A video may arrive as several items (a live session's frame pairs): an item whose data carries
`video_time_offset` = k > 0 continues the video item right before it (no tokens between them) as its temporal grid
steps k, k+1, ...: its positions are those the same steps get in one item holding the whole video.

A pruned video (video_pruning.py) holds fewer placeholders than its grid: they take the positions of the kept tokens
(`kept_indices[mm_hash]`, known once its tower ran; before that, provisionally the first ones of the grid), and
what follows it is positioned as after the whole grid.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vlserve.multimodal.inputs import MultiModalFeature
from vlserve.multimodal.video_pruning import KEEP_KEY, pruning_rate


def _vision_config(hf_config: Any) -> Any:
    return getattr(hf_config, "vision_config", hf_config)


def _grid(feature: MultiModalFeature) -> tuple[int, int, int]:
    key = "image_grid_thw" if feature.modality == "image" else "video_grid_thw"
    grid = feature.data[key]
    grid = grid.tolist() if hasattr(grid, "tolist") else grid  # one call for a tensor's three values
    t, h, w = (int(v) for v in (grid[0] if isinstance(grid[0], (list, tuple)) else grid))
    return t, h, w


def _second_per_grid(feature: MultiModalFeature) -> float:
    spg = feature.data.get("second_per_grid_ts")
    if spg is None:
        return 1.0  # HF's default when second_per_grid_ts is not given
    if hasattr(spg, "reshape"):
        return float(spg.reshape(-1)[0])
    return float(spg[0]) if isinstance(spg, (list, tuple)) else float(spg)


def _time_offset(feature: MultiModalFeature) -> int:
    """The temporal grid steps of the same video before this item (0: the item starts its own video)."""
    offset = feature.data.get("video_time_offset", 0)
    return int(offset.reshape(-1)[0]) if hasattr(offset, "reshape") else int(offset)


@functools.lru_cache(maxsize=4096)
def _grid_positions(
    llm_t: int, llm_h: int, llm_w: int, time_offset: int, time_scale: tuple[float, int, bool] | int | None
) -> tuple[torch.Tensor, int]:
    """The (t, h, w) ids [3, llm_t*llm_h*llm_w] of an item's grid counted from its video's start, and their
    maximum. `time_scale`: None keeps t (Qwen2-VL), 0 zeroes it (Qwen2.5-VL images), (second_per_grid,
    tokens_per_second, truncate) scales it (Qwen2.5-VL videos). Cached: a live session's items repeat their grids;
    callers add to it, never write into it."""
    t_idx = torch.arange(time_offset, time_offset + llm_t, dtype=torch.long)  # [llm_t]
    if time_scale == 0:
        t_idx = t_idx * 0
    elif time_scale is not None:
        spg, tokens_per_second, truncate = time_scale
        if truncate:
            t_idx = (t_idx * int(spg) * tokens_per_second).long()
        else:
            t_idx = (t_idx.double() * spg * tokens_per_second).long()
    t_ids = t_idx.view(-1, 1).expand(-1, llm_h * llm_w).flatten()  # [n]
    h_ids = torch.arange(llm_h).view(1, -1, 1).expand(llm_t, -1, llm_w).flatten()  # [n]
    w_ids = torch.arange(llm_w).view(1, 1, -1).expand(llm_t, llm_h, -1).flatten()  # [n]
    positions = torch.stack([t_ids, h_ids, w_ids])  # [3, n]
    return positions, int(positions.max())


def get_mrope_positions(
    prompt_token_ids: Sequence[int],
    mm_features: list[MultiModalFeature],
    hf_config: Any,
    truncate_second_per_grid: bool = True,
    kept_indices: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, int]:
    """Return (positions int64 [3, L], mrope_position_delta) for a whole (already expanded) prompt.

    Matches transformers' Qwen2VLModel.get_rope_index (Qwen2-VL) / Qwen2_5_VLModel.get_rope_index (Qwen2.5-VL,
    detected by `vision_config.tokens_per_second`). Each feature's [offset, offset+length) must hold exactly
    grid_t*grid_h*grid_w // merge**2 placeholder tokens, or, for a pruned video, its retained count; such a
    video's tokens take the grid positions `kept_indices.get(mm_hash)` (int64 [length], ascending) names.
    """
    num_tokens = len(prompt_token_ids)
    vcfg = _vision_config(hf_config)
    merge = int(getattr(vcfg, "spatial_merge_size", 2))
    tokens_per_second = getattr(vcfg, "tokens_per_second", None)  # None => Qwen2-VL (no time scaling)

    chunks: list[torch.Tensor] = []  # each [3, n]
    st = 0  # next unprocessed token index
    next_pos = 0  # max position so far + 1
    video_start = 0  # the first position of the latest video item (what a continuing item counts from)
    for f in sorted(mm_features, key=lambda f: f.offset):
        t, h, w = _grid(f)
        llm_t, llm_h, llm_w = t, h // merge, w // merge
        rate = pruning_rate(f.data)
        expected = int(f.data[KEEP_KEY]) if rate else llm_t * llm_h * llm_w
        if expected != f.length:
            raise ValueError(
                f"{f.modality} feature at offset {f.offset} has length {f.length} but its grid "
                f"({t}, {h}, {w}) with merge size {merge} (pruning rate {rate}) needs {expected} tokens"
            )
        if f.offset < st or f.end > num_tokens:
            raise ValueError(
                f"{f.modality} feature [{f.offset}, {f.end}) overlaps another or exceeds the prompt length {num_tokens}"
            )
        time_offset = _time_offset(f)
        if time_offset and (f.modality != "video" or f.offset != st or not chunks):
            raise ValueError(
                f"{f.modality} feature at offset {f.offset} continues a video (video_time_offset={time_offset}) "
                "but does not follow a video item directly"
            )
        text_len = f.offset - st
        if text_len:
            chunks.append(torch.arange(text_len, dtype=torch.long).expand(3, -1) + next_pos)
            next_pos += text_len
        if not time_offset:
            video_start = next_pos
        if f.modality == "video" and tokens_per_second is not None:
            time_scale = (_second_per_grid(f), tokens_per_second, truncate_second_per_grid)
        else:
            time_scale = None if tokens_per_second is None else 0  # Qwen2.5-VL images: second_per_grid_t = 0
        grid_positions, grid_max = _grid_positions(llm_t, llm_h, llm_w, time_offset, time_scale)
        vision = grid_positions + video_start  # [3, n]
        next_pos = max(next_pos, grid_max + video_start + 1)  # after the whole grid, pruned or not
        if rate:
            kept = (kept_indices or {}).get(f.mm_hash)
            vision = vision[:, : f.length] if kept is None else vision[:, kept.to(torch.long)]  # [3, length]
        chunks.append(vision)
        st = f.end
    if st < num_tokens:
        chunks.append(torch.arange(num_tokens - st, dtype=torch.long).expand(3, -1) + next_pos)
        next_pos += num_tokens - st
    if not chunks:
        return torch.zeros(3, 0, dtype=torch.long), 0
    positions = torch.cat(chunks, dim=1)  # [3, L]
    return positions, next_pos - num_tokens


def decode_mrope_positions(mrope_position_delta: int, start: int, end: int) -> torch.Tensor:
    """Positions int64 [3, end - start] of the tokens at sequence indices [start, end) after the prompt."""
    pos = torch.arange(start + mrope_position_delta, end + mrope_position_delta, dtype=torch.long)  # [n]
    return pos.expand(3, -1).contiguous()  # [3, n]


def mrope_positions_for_range(
    prompt_positions: torch.Tensor, mrope_position_delta: int, start: int, end: int
) -> torch.Tensor:
    """Positions [3, end - start] for sequence indices [start, end): prompt positions where available (chunked
    prefill), then decode positions (index + delta) for generated tokens."""
    num_prompt = prompt_positions.shape[1]
    parts = []
    if start < num_prompt:
        parts.append(prompt_positions[:, start : min(end, num_prompt)])
    if end > num_prompt:
        parts.append(decode_mrope_positions(mrope_position_delta, max(start, num_prompt), end))
    if not parts:
        return torch.zeros(3, 0, dtype=torch.long)
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
