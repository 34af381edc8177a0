"""Staged tower execution: a tower whose blocks can run a slice at a time, so the runner can encode one large media
item over several engine steps (a slice of its layers per step) instead of stalling every running stream for the
whole tower. A tower without this protocol runs in one piece (one stage).

Protocol: `num_stages` (its blocks), `begin_stages(pixels, grid_thw)` (patch embedding, rotary tables, attention
segments) -> `TowerState`, `run_stages(state, start, end)` (blocks [start, end) on the carried hidden rows) and
`finish_stages(state)` (merger / projector) -> `[num_embeds, O]`. Running every stage in one go equals `forward`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class TowerState:
    """What one tower call carries between stages (tensors on the tower's device)."""

    hidden: torch.Tensor  # [P, E] patch rows after the stages run so far
    rotary: Any  # the blocks' rotary inputs (vision_layers.VisionRotary)
    frames: Any  # full-attention segments (vision_layers.AttentionSegments)
    windows: Any = None  # window-attention segments (Qwen2.5-VL), else None
    order: torch.Tensor | None = None  # [P / unit] window order of the merge units (Qwen2.5-VL), else None


@runtime_checkable
class StagedTower(Protocol):
    """A tower that runs its blocks a slice at a time (see the module docstring)."""

    num_stages: int

    def begin_stages(self, pixels: torch.Tensor, grid_thw) -> TowerState: ...

    def run_stages(self, state: TowerState, start: int, end: int) -> TowerState: ...

    def finish_stages(self, state: TowerState) -> torch.Tensor: ...
