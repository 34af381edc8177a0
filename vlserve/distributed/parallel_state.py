"""Which tensor-parallel rank this process is, and its torch.distributed process group.

A process that never called `init_tensor_parallel` is rank 0 of 1: every model layer then runs unsharded and no
collective is issued, so single-process serving never touches torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelInfo:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    world_size: int = 1


_INFO = TensorParallelInfo()


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str) -> None:
    """Join the group of `world_size` ranks at `init_method` (e.g. "tcp://127.0.0.1:PORT") over `backend`
    ("gloo" on CPU, "nccl" on CUDA). Called once per worker process, before the model is built."""
    global _INFO
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {world_size}")
    if world_size > 1:
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size)
    _INFO = TensorParallelInfo(rank, world_size)


def destroy_tensor_parallel() -> None:
    """Leave the group (a no-op when there is none)."""
    global _INFO
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _INFO = TensorParallelInfo()


def tp_rank() -> int:
    """This process's tensor-parallel rank (0 when not sharded)."""
    return _INFO.rank


def tp_size() -> int:
    """The number of tensor-parallel ranks (1 when not sharded)."""
    return _INFO.world_size
