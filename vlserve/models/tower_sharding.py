"""Tensor-parallel vision towers (`mm_encoder_tp_mode="weights"` above one rank): the transformer blocks of the
Qwen2-VL, Qwen2.5-VL and Qwen3-VL towers (`encoders.vision_layers.VisionBlock`) split Megatron-style over the
tensor-parallel ranks, once the whole tower is loaded.

Per block, with `tp` ranks and `r` this rank:
- attention: the fused qkv keeps this rank's heads of q, k and v (`[3 * E / tp, E]`, laid out q | k | v as the
  whole one, so the block's forward views it as `[P, 3, H / tp, Hd]`); attention runs over those heads; `proj` is
  row-parallel (its input columns of those heads, `[E, E / tp]`), the partial outputs summed over the ranks
  (`models.parallel_layers.RowParallelLinear`: one all-reduce), its bias added once.
- MLP: the up projections (`fc1`, `gate_proj` / `up_proj`, `linear_fc1`) column-parallel `[I / tp, E]`, the down
  projection (`fc2`, `down_proj`, `linear_fc2`) row-parallel `[E, I / tp]` with one all-reduce.
Norms, the patch embedding, the rotary tables and the mergers stay whole on every rank, and every rank runs them on
every row, so each rank's tower gives the same embeddings. Towers of other blocks (CLIP, SigLIP, InternViT, Pixtral,
audio), and a tower whose heads or MLP width do not divide by the ranks (a warning says so), stay replicated.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from vlserve.distributed.parallel_state import tp_rank, tp_size
from vlserve.encoders.vision_layers import VisionAttention, VisionBlock
from vlserve.kernels.packed_linear import PackableLinear
from vlserve.models.parallel_layers import ColumnParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)

UP_PROJECTIONS = ("fc1", "gate_proj", "up_proj", "linear_fc1")  # column-parallel
DOWN_PROJECTIONS = ("fc2", "down_proj", "linear_fc2")  # row-parallel


def _like(new: nn.Module, old: PackableLinear) -> nn.Module:
    return new.to(device=old.weight.device, dtype=old.weight.dtype)


def column_shard(linear: PackableLinear, rows: torch.Tensor) -> ColumnParallelLinear:
    """A column-parallel copy of `linear` keeping output rows `rows` (this rank's)."""
    new = _like(ColumnParallelLinear(linear.in_features, linear.out_features, bias=linear.bias is not None), linear)
    new.weight.data.copy_(linear.weight.data[rows])
    if linear.bias is not None:
        new.bias.data.copy_(linear.bias.data[rows])
    return new


def row_shard(linear: PackableLinear, columns: torch.Tensor) -> RowParallelLinear:
    """A row-parallel copy of `linear` keeping input columns `columns` (this rank's); the bias whole."""
    new = _like(RowParallelLinear(linear.in_features, linear.out_features, bias=linear.bias is not None), linear)
    new.weight.data.copy_(linear.weight.data[:, columns])
    if linear.bias is not None:
        new.bias.data.copy_(linear.bias.data)
    return new


def _shard_attention(attn: VisionAttention, tp: int, rank: int) -> None:
    heads, head_dim = attn.num_heads, attn.head_dim
    local = heads // tp
    width = heads * head_dim
    mine = torch.arange(rank * local * head_dim, (rank + 1) * local * head_dim)  # this rank's heads' channels
    attn.qkv = column_shard(attn.qkv, torch.cat([mine, mine + width, mine + 2 * width]))  # q | k | v rows
    attn.proj = row_shard(attn.proj, mine)
    attn.num_heads = local


def _shard_mlp(mlp: nn.Module, tp: int, rank: int) -> None:
    for name in UP_PROJECTIONS:
        linear = getattr(mlp, name, None)
        if linear is not None:
            n = linear.out_features // tp
            setattr(mlp, name, column_shard(linear, torch.arange(rank * n, (rank + 1) * n)))
    for name in DOWN_PROJECTIONS:
        linear = getattr(mlp, name, None)
        if linear is not None:
            n = linear.in_features // tp
            setattr(mlp, name, row_shard(linear, torch.arange(rank * n, (rank + 1) * n)))


def shardable_blocks(parts: list[nn.Module]) -> list[VisionBlock]:
    """The blocks of these encoder parts that `shard_tower_blocks` splits."""
    return [m for part in parts for m in part.modules() if isinstance(m, VisionBlock)]


def shard_tower_blocks(parts: list[nn.Module]) -> int:
    """Split the loaded VisionBlocks of these encoder parts over this process's tensor-parallel ranks, in place;
    how many were split: 0 with one rank, or when some block's heads or MLP width do not divide by the ranks (the
    tower then stays whole, with a warning)."""
    tp, rank = tp_size(), tp_rank()
    blocks = shardable_blocks(parts)
    if tp == 1 or not blocks:
        return 0
    for block in blocks:
        widths = [getattr(block.mlp, n).out_features for n in UP_PROJECTIONS if hasattr(block.mlp, n)]
        if block.attn.num_heads % tp or any(w % tp for w in widths):
            logger.warning(
                "mm_encoder_tp_mode='weights': the vision tower's %d heads and MLP width %s do not divide by "
                "tensor_parallel_size %d; the tower stays whole on every rank (mm_encoder_tp_mode='data' splits "
                "the items instead)",
                block.attn.num_heads,
                widths,
                tp,
            )
            return 0
    for block in blocks:
        _shard_attention(block.attn, tp, rank)
        _shard_mlp(block.mlp, tp, rank)
    return len(blocks)
