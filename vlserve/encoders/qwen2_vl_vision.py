"""The Qwen2-VL vision tower (a ViT with 2-D rotary attention and a 2x2 patch merger) on vlserve's kernels.

`Qwen2VisionTower(cfg)(pixels [P, C*tp*p*p], grids)` -> `[P / merge**2, O]`: every image and video of a step goes
through in one call, each frame attending only to its own patches (one varlen attention call per block).
Parameter names match HF's `visual.*` weights.
"""

from __future__ import annotations

import torch
from torch import nn

from vlserve.encoders.staged import TowerState
from vlserve.encoders.vision_layers import (
    AttentionSegments,
    Grid,
    PatchEmbed,
    PatchMerger,
    VisionBlock,
    VisionMLP,
    VisionTowerConfig,
    build_vision_rotary,
    check_grids,
    frame_lengths,
    merge_ordered_positions,
)


def qwen2_vl_tower_config(vision_config) -> VisionTowerConfig:
    """Read a Qwen2-VL `vision_config` (width is `embed_dim`; the merger projects to `hidden_size`)."""
    width = getattr(vision_config, "embed_dim", None) or vision_config.hidden_size
    out_dim = getattr(vision_config, "out_hidden_size", None) or vision_config.hidden_size
    return VisionTowerConfig(
        depth=vision_config.depth,
        width=width,
        num_heads=vision_config.num_heads,
        mlp_hidden=int(width * getattr(vision_config, "mlp_ratio", 4)),
        hidden_act=getattr(vision_config, "hidden_act", "quick_gelu"),
        out_dim=out_dim,
        in_channels=getattr(vision_config, "in_channels", 3),
        patch_size=vision_config.patch_size,
        temporal_patch_size=vision_config.temporal_patch_size,
        spatial_merge_size=vision_config.spatial_merge_size,
    )


def as_grid_list(grid_thw) -> list[Grid]:
    """`[N, 3]` tensor / nested sequence of (t, h, w) -> list of int triples."""
    if isinstance(grid_thw, torch.Tensor):
        grid_thw = grid_thw.reshape(-1, 3).tolist()
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw]


class Qwen2VisionTower(nn.Module):
    """Qwen2-VL's vision transformer: patch_embed -> blocks -> merger."""

    norm_kind = "layernorm"

    def __init__(self, cfg: VisionTowerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList([self._make_block(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, self.norm_kind)

    @staticmethod
    def _make_block(cfg: VisionTowerConfig) -> nn.Module:
        return VisionBlock(cfg, "layernorm", VisionMLP(cfg))

    def num_embeddings(self, grids) -> list[int]:
        """LLM embeddings each item yields: t * h * w / merge**2."""
        unit = self.cfg.spatial_merge_size**2
        return [t * h * w // unit for t, h, w in as_grid_list(grids)]

    @property
    def num_stages(self) -> int:
        """Stages of staged execution (`vlserve.encoders.staged`): one per block."""
        return len(self.blocks)

    def begin_stages(self, pixels: torch.Tensor, grid_thw) -> TowerState:
        """`pixels [P, C*tp*p*p]`, N grids -> the state before block 0: patch embeddings, rotary tables, frames."""
        grids = as_grid_list(grid_thw)
        check_grids(grids, pixels, self.cfg)
        device = self.patch_embed.proj.param.device
        x = self.patch_embed(pixels.to(device))  # [P, E]
        positions = merge_ordered_positions(grids, self.cfg.spatial_merge_size)  # [P, 2]
        rotary = build_vision_rotary(positions, self.cfg.width // self.cfg.num_heads, device)
        return TowerState(x, rotary, AttentionSegments.from_lengths(frame_lengths(grids), device))

    def run_stages(self, state: TowerState, start: int, end: int) -> TowerState:
        """Run blocks [start, end) on `state.hidden [P, E]` (in place of the state's rows)."""
        for i in range(start, end):
            state.hidden = self.blocks[i](state.hidden, state.rotary, self._segments(state, i))
        return state

    def _segments(self, state: TowerState, block_index: int):
        return state.frames  # every Qwen2-VL block attends over whole frames

    def finish_stages(self, state: TowerState) -> torch.Tensor:
        """The merger over the last block's rows -> `[P / merge**2, O]`."""
        return self.merger(state.hidden)

    def forward(self, pixels: torch.Tensor, grid_thw) -> torch.Tensor:
        """`pixels [P, C*tp*p*p]` of N items concatenated, `grid_thw` N rows of (t, h, w) -> `[P / merge**2, O]`."""
        state = self.begin_stages(pixels, grid_thw)
        return self.finish_stages(self.run_stages(state, 0, self.num_stages))
