"""The Qwen2.5-VL vision tower: Qwen2-VL's ViT with RMSNorm, a SiLU-gated MLP and windowed attention.

Most blocks attend within square windows of `window_size` pixels (in merge units: window_size // merge // patch);
the blocks in `fullatt_block_indexes` attend over whole frames. To make windows contiguous row ranges (so one varlen
call covers them), the merge units of each frame are permuted into window order before the blocks and the merged
embeddings are put back in processor order after the merger. Parameter names match HF's `visual.*` weights.
"""

from __future__ import annotations

import torch
from torch import nn

from vlserve.encoders.qwen2_vl_vision import Qwen2VisionTower, as_grid_list
from vlserve.encoders.staged import TowerState
from vlserve.encoders.vision_layers import (
    AttentionSegments,
    Grid,
    VisionBlock,
    VisionTowerConfig,
    build_vision_rotary,
    check_grids,
    frame_lengths,
    merge_ordered_positions,
)
from vlserve.kernels.activation import activation
from vlserve.kernels.packed_linear import PackableLinear


def qwen2_5_vl_tower_config(vision_config) -> VisionTowerConfig:
    """Read a Qwen2.5-VL `vision_config` (width is `hidden_size`; the merger projects to `out_hidden_size`)."""
    return VisionTowerConfig(
        depth=vision_config.depth,
        width=vision_config.hidden_size,
        num_heads=vision_config.num_heads,
        mlp_hidden=vision_config.intermediate_size,
        hidden_act=getattr(vision_config, "hidden_act", "silu"),
        out_dim=vision_config.out_hidden_size,
        in_channels=getattr(vision_config, "in_channels", 3),
        patch_size=vision_config.patch_size,
        temporal_patch_size=vision_config.temporal_patch_size,
        spatial_merge_size=vision_config.spatial_merge_size,
        window_size=vision_config.window_size,
        fullatt_block_indexes=tuple(vision_config.fullatt_block_indexes),
    )


def window_order(merged_grids: list[Grid], window_units: int) -> tuple[torch.Tensor, list[int]]:
    """Merge units in window order -> (`index [P / unit]` int64: the processor-order unit at each new place,
    units per window in that order). `merged_grids` count merge units (t, h // merge, w // merge); windows of
    window_units x window_units tile each frame row-major, edge windows may be smaller."""
    index, sizes, base = [], [], 0
    for t, rows, cols in merged_grids:
        units = torch.arange(t * rows * cols).view(t, rows, cols)
        pad_r, pad_c = (-rows) % window_units, (-cols) % window_units
        padded = torch.nn.functional.pad(units, (0, pad_c, 0, pad_r), value=-1)  # [t, R, C]
        nr, nc = padded.shape[1] // window_units, padded.shape[2] // window_units
        windows = padded.view(t, nr, window_units, nc, window_units).permute(0, 1, 3, 2, 4)
        windows = windows.reshape(t * nr * nc, window_units * window_units)  # [num_windows, ws*ws]
        valid = windows >= 0
        index.append(windows[valid] + base)
        sizes.extend(n for n in valid.sum(1).tolist() if n > 0)
        base += t * rows * cols
    return torch.cat(index), sizes


class Qwen2_5VisionMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), with biases."""

    def __init__(self, cfg: VisionTowerConfig) -> None:
        super().__init__()
        self.gate_proj = PackableLinear(cfg.width, cfg.mlp_hidden)
        self.up_proj = PackableLinear(cfg.width, cfg.mlp_hidden)
        self.down_proj = PackableLinear(cfg.mlp_hidden, cfg.width)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Qwen2_5VisionTower(Qwen2VisionTower):
    """Qwen2.5-VL's vision transformer: patch_embed -> window permutation -> blocks -> merger -> unpermute (staged
    as Qwen2-VL's: `forward` is Qwen2VisionTower's, over these stages)."""

    norm_kind = "rmsnorm"

    def __init__(self, cfg: VisionTowerConfig) -> None:
        merge_px = cfg.spatial_merge_size * cfg.patch_size
        if cfg.window_size < merge_px:
            raise ValueError(
                f"vision window_size {cfg.window_size} must be at least spatial_merge_size * patch_size = {merge_px}"
            )
        super().__init__(cfg)

    @staticmethod
    def _make_block(cfg: VisionTowerConfig) -> nn.Module:
        return VisionBlock(cfg, "rmsnorm", Qwen2_5VisionMLP(cfg))

    def begin_stages(self, pixels: torch.Tensor, grid_thw) -> TowerState:
        """`pixels [P, C*tp*p*p]`, N grids -> the state before block 0, its rows in window order."""
        cfg = self.cfg
        grids = as_grid_list(grid_thw)
        check_grids(grids, pixels, cfg)
        merge, unit = cfg.spatial_merge_size, cfg.spatial_merge_size**2
        device = self.patch_embed.proj.param.device
        merged_grids = [(t, h // merge, w // merge) for t, h, w in grids]
        order, window_sizes = window_order(merged_grids, cfg.window_size // merge // cfg.patch_size)
        order_dev = order.to(device)  # [P / unit]

        x = self.patch_embed(pixels.to(device))  # [P, E], processor order
        num_rows = x.shape[0]
        x = x.view(num_rows // unit, unit, -1)[order_dev].view(num_rows, -1)  # window order
        positions = merge_ordered_positions(grids, merge)  # [P, 2]
        positions = positions.view(num_rows // unit, unit, 2)[order].view(num_rows, 2)
        rotary = build_vision_rotary(positions, cfg.width // cfg.num_heads, device)
        # the permutation stays inside each frame, so frames are still contiguous row ranges
        frames = AttentionSegments.from_lengths(frame_lengths(grids), device)
        windows = AttentionSegments.from_lengths([n * unit for n in window_sizes], device)
        return TowerState(x, rotary, frames, windows, order_dev)

    def _segments(self, state: TowerState, block_index: int):
        return state.frames if block_index in self.cfg.fullatt_block_indexes else state.windows

    def finish_stages(self, state: TowerState) -> torch.Tensor:
        """The merger, then the embeddings back in processor order -> `[P / merge**2, O]`."""
        merged = self.merger(state.hidden)  # [P / unit, O], window order
        out = torch.empty_like(merged)
        out[state.order] = merged  # back to processor order
        return out
