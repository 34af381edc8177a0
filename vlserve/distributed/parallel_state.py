"""Which tensor- and pipeline-parallel rank this process is, and its torch.distributed process groups.

Global ranks are laid out stage by stage: rank = pp_rank * tp_size + tp_rank, so with one tensor-parallel rank per
stage the global rank is the stage. With both axes wider than 1 (TP x PP) the tensor-parallel collectives run on the
group of the stage's ranks (`tp_group`: ranks [s * tp, (s + 1) * tp)) and the pipeline hand-over on the group of
the ranks holding the same shard in every stage (`pp_group`: ranks t, t + tp, t + 2 tp, ...); with one axis of
size 1 the other's group is the default (whole) group and no subgroup is made. A process that never joined a group
is rank 0 of 1 on both axes: every model layer then runs unsharded and whole, and single-process serving never
touches torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelInfo:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    world_size: int = 1


@dataclass(frozen=True)
class PipelineParallelInfo:
    """This process's pipeline stage (`rank`) out of `world_size` stages, and its tensor-parallel width."""

    rank: int = 0
    world_size: int = 1
    tp_size: int = 1

    def global_rank_of(self, stage: int) -> int:
        """The global rank of `stage` that holds the same tensor-parallel shard as this process."""
        return stage * self.tp_size + _INFO.rank


_INFO = TensorParallelInfo()
_PP = PipelineParallelInfo()
_PP_GROUP = None  # this process's pipeline group (None: the default group, which is it when tp_size == 1)
_TP_GROUP = None  # this process's tensor-parallel group (None: the default group, which is it when pp_size == 1)


def init_model_parallel(rank: int, tp_size_: int, pp_size_: int, init_method: str, backend: str) -> None:
    """Join the group of `tp_size_ * pp_size_` global ranks at `init_method` (e.g. "tcp://127.0.0.1:PORT") over
    `backend` ("gloo" on CPU, "nccl" on CUDA). Called once per worker process, before the model is built."""
    global _INFO, _PP, _PP_GROUP, _TP_GROUP
    world = tp_size_ * pp_size_
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a group of {world} ranks ({tp_size_} TP x {pp_size_} PP)")
    if world > 1:
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world)
    _INFO = TensorParallelInfo(rank % tp_size_, tp_size_)
    _PP = PipelineParallelInfo(rank // tp_size_, pp_size_, tp_size_)
    _PP_GROUP = _TP_GROUP = None
    if tp_size_ > 1 and pp_size_ > 1:  # every rank makes every subgroup, in the same order (new_group's rule)
        for stage in range(pp_size_):
            group = dist.new_group(list(range(stage * tp_size_, (stage + 1) * tp_size_)))
            if stage == _PP.rank:
                _TP_GROUP = group
        for shard in range(tp_size_):
            group = dist.new_group(list(range(shard, world, tp_size_)))
            if shard == _INFO.rank:
                _PP_GROUP = group


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str) -> None:
    """Join a tensor-parallel group of `world_size` ranks (one pipeline stage); see `init_model_parallel`."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {world_size}")
    init_model_parallel(rank, world_size, 1, init_method, backend)


def destroy_tensor_parallel() -> None:
    """Leave the groups (a no-op when there are none)."""
    global _INFO, _PP, _PP_GROUP, _TP_GROUP
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _INFO, _PP, _PP_GROUP, _TP_GROUP = TensorParallelInfo(), PipelineParallelInfo(), None, None


def tp_rank() -> int:
    """This process's tensor-parallel rank (0 when not sharded)."""
    return _INFO.rank


def tp_size() -> int:
    """The number of tensor-parallel ranks (1 when not sharded)."""
    return _INFO.world_size


def pp_info() -> PipelineParallelInfo:
    """This process's pipeline stage, the number of stages and the tensor-parallel width."""
    return _PP


def pp_rank() -> int:
    """This process's pipeline stage (0 without pipeline parallelism)."""
    return _PP.rank


def pp_size() -> int:
    """The number of pipeline stages (1 without pipeline parallelism)."""
    return _PP.world_size


def pp_group():
    """The process group of this process's pipeline (the default group while there is one rank per stage)."""
    return _PP_GROUP


def tp_group():
    """The process group of this stage's tensor-parallel ranks (the default group while there is one stage)."""
    return _TP_GROUP
