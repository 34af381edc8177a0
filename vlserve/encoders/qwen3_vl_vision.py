"""The Qwen3-VL vision tower: a ViT with a learned position grid resampled to every image, 2-D rotary attention,
a 2x2 patch merger, and DeepStack mergers that project the output of chosen blocks for the first decoder layers.

`Qwen3VisionTower(cfg)(pixels [P, C*tp*p*p], grids)` -> `[P / merge**2, O * (1 + K)]`: the main merger's output
followed by the K DeepStack features of each LLM token, concatenated on the last axis (the model splits them).
Every image and video frame of a step goes through in one call, each frame attending only to its own patches.
Parameter names match HF's `model.visual.*` weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from vlserve.encoders.qwen2_vl_vision import as_grid_list
from vlserve.encoders.vision_layers import (
    AttentionSegments,
    Grid,
    PatchEmbed,
    VisionBlock,
    VisionTowerConfig,
    build_vision_rotary,
    check_grids,
    frame_lengths,
    merge_ordered_positions,
)
from vlserve.kernels.activation import activation
from vlserve.kernels.packed_linear import PackableLinear


@dataclass(frozen=True)
class Qwen3VisionConfig(VisionTowerConfig):
    """Qwen2-VL's tower fields plus the learned position grid and the DeepStack block indexes."""

    num_position_embeddings: int = 2304  # a square grid of side sqrt(n)
    deepstack_visual_indexes: tuple[int, ...] = field(default_factory=tuple)


def qwen3_vl_tower_config(vision_config) -> Qwen3VisionConfig:
    """Read a Qwen3-VL `vision_config` (width is `hidden_size`; mergers project to `out_hidden_size`)."""
    return Qwen3VisionConfig(
        depth=vision_config.depth,
        width=vision_config.hidden_size,
        num_heads=vision_config.num_heads,
        mlp_hidden=vision_config.intermediate_size,
        hidden_act=vision_config.hidden_act,
        out_dim=vision_config.out_hidden_size,
        in_channels=getattr(vision_config, "in_channels", 3),
        patch_size=vision_config.patch_size,
        temporal_patch_size=vision_config.temporal_patch_size,
        spatial_merge_size=vision_config.spatial_merge_size,
        num_position_embeddings=vision_config.num_position_embeddings,
        deepstack_visual_indexes=tuple(vision_config.deepstack_visual_indexes),
    )


def bilinear_grid_taps(positions: torch.Tensor, grids: list[Grid], side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Resample a `side x side` learned grid to every patch: `positions [P, 2]` (row, col) of patches of frames
    with the given grids -> (`index [P, 4]` int64 into the flattened grid, `weight [P, 4]` float32), bilinear with
    the corners aligned (the grid's corners land on each frame's corner patches)."""
    heights = torch.cat([torch.full((t * h * w,), h) for t, h, w in grids])  # [P]
    widths = torch.cat([torch.full((t * h * w,), w) for t, h, w in grids])

    def axis(coord: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        src = coord.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)  # [P]
        low = torch.floor(src)
        taps = (low.long()[:, None] + torch.arange(2)).clamp(0, side - 1)  # [P, 2]
        weight = (1 - (src[:, None] - low[:, None] - torch.arange(2)).abs()).clamp(min=0)  # [P, 2]
        return taps, weight

    rows, row_w = axis(positions[:, 0], heights)
    cols, col_w = axis(positions[:, 1], widths)
    index = (rows[:, :, None] * side + cols[:, None, :]).reshape(-1, 4)
    weight = (row_w[:, :, None] * col_w[:, None, :]).reshape(-1, 4)
    return index, weight


class Qwen3VisionMLP(nn.Module):
    """linear_fc2(act(linear_fc1(x))), with biases."""

    def __init__(self, cfg: VisionTowerConfig) -> None:
        super().__init__()
        self.linear_fc1 = PackableLinear(cfg.width, cfg.mlp_hidden)
        self.linear_fc2 = PackableLinear(cfg.mlp_hidden, cfg.width)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))  # [P, E] -> [P, E]


class Qwen3PatchMerger(nn.Module):
    """LayerNorm, concatenate each merge x merge block, then a 2-layer GELU MLP: `[P, E]` -> `[P/unit, O]`. The
    DeepStack mergers normalize after concatenating (`postshuffle_norm`), the main one before."""

    def __init__(self, cfg: VisionTowerConfig, postshuffle_norm: bool) -> None:
        super().__init__()
        self.merged_width = cfg.width * cfg.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_width if postshuffle_norm else cfg.width, eps=1e-6)
        self.linear_fc1 = PackableLinear(self.merged_width, self.merged_width)
        self.act = nn.GELU()
        self.linear_fc2 = PackableLinear(self.merged_width, cfg.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.merged_width))
        else:
            x = self.norm(x).view(-1, self.merged_width)  # [P/unit, E*unit]
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionTower(nn.Module):
    """patch_embed (+ resampled pos_embed) -> blocks (DeepStack taps) -> merger; see the module docstring."""

    def __init__(self, cfg: Qwen3VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.grid_side = int(cfg.num_position_embeddings**0.5)
        if self.grid_side**2 != cfg.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {cfg.num_position_embeddings} must be a square")
        bad = [i for i in cfg.deepstack_visual_indexes if not 0 <= i < cfg.depth]
        if bad:
            raise ValueError(f"deepstack_visual_indexes {bad} out of range for a tower of depth {cfg.depth}")
        self.patch_embed = PatchEmbed(cfg, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.width)
        self.blocks = nn.ModuleList([VisionBlock(cfg, "layernorm", Qwen3VisionMLP(cfg)) for _ in range(cfg.depth)])
        self.merger = Qwen3PatchMerger(cfg, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            [Qwen3PatchMerger(cfg, postshuffle_norm=True) for _ in cfg.deepstack_visual_indexes]
        )

    @property
    def num_deepstack_levels(self) -> int:
        """K: DeepStack features per LLM token."""
        return len(self.cfg.deepstack_visual_indexes)

    def num_embeddings(self, grids) -> list[int]:
        """LLM embeddings each item yields: t * h * w / merge**2."""
        unit = self.cfg.spatial_merge_size**2
        return [t * h * w // unit for t, h, w in as_grid_list(grids)]

    def forward(self, pixels: torch.Tensor, grid_thw) -> torch.Tensor:
        """`pixels [P, C*tp*p*p]` of N items concatenated, `grid_thw` N rows of (t, h, w) ->
        `[P / merge**2, O * (1 + K)]`."""
        cfg = self.cfg
        grids = as_grid_list(grid_thw)
        check_grids(grids, pixels, cfg)
        device = self.patch_embed.proj.param.device
        x = self.patch_embed(pixels.to(device))  # [P, E]
        positions = merge_ordered_positions(grids, cfg.spatial_merge_size)  # [P, 2]
        index, weight = bilinear_grid_taps(positions, grids, self.grid_side)  # [P, 4] each
        pos = (self.pos_embed(index.to(device)) * weight.to(device)[:, :, None]).sum(1)  # [P, E] float32
        x = x + pos.to(x.dtype)
        rotary = build_vision_rotary(positions, cfg.width // cfg.num_heads, device)
        frames = AttentionSegments.from_lengths(frame_lengths(grids), device)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, rotary, frames)
            if i in cfg.deepstack_visual_indexes:
                level = cfg.deepstack_visual_indexes.index(i)
                deepstack.append(self.deepstack_merger_list[level](x))  # [P / unit, O]
        return torch.cat([self.merger(x), *deepstack], dim=-1)  # [P / unit, O * (1 + K)]
