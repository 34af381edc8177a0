"""Collectives over the tensor-parallel group, as opaque custom ops so compiled forwards keep them whole.

`tp_all_reduce` and `tp_all_gather` return their input unchanged when there is one rank (no torch.distributed
call at all). They run on this stage's tensor-parallel group (`tp_group`; the default group without pipeline
stages). With several ranks they call `torch.ops.vlserve.tp_all_reduce` / `tp_all_gather`: out-of-place
custom ops (a fresh output tensor), so dynamo records one node per collective instead of tracing
torch.distributed, and their fake implementations give inductor the output shape.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vlserve.distributed.parallel_state import tp_group, tp_size


@torch.library.custom_op("vlserve::tp_all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over every rank of the group (a new tensor of x's shape)."""
    out = x.clone()
    dist.all_reduce(out, group=tp_group())
    return out


@_all_reduce_op.register_fake
def _all_reduce_fake(x):
    return torch.empty_like(x)


@torch.library.custom_op("vlserve::tp_all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, dim: int, world_size: int) -> torch.Tensor:
    """The ranks' `x` concatenated along `dim` in rank order (`x.shape[dim] * world_size` there)."""
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(pieces, x, group=tp_group())
    return torch.cat(pieces, dim=dim)


@_all_gather_op.register_fake
def _all_gather_fake(x, dim, world_size):
    shape = list(x.shape)
    shape[dim] *= world_size
    return x.new_empty(shape)


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group; `x` itself when there is one rank."""
    if tp_size() == 1:
        return x
    return _all_reduce_op(x)


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate the ranks' `x` along `dim` (rank 0's piece first); `x` itself when there is one rank."""
    world = tp_size()
    if world == 1:
        return x
    return _all_gather_op(x, dim % x.dim(), world)
