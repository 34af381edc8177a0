"""Pipeline parallelism: which decoder layers each stage holds, and what stages hand each other.

The decoder's layers are split into `pp_size` contiguous runs, evenly by default (the first stages take one layer
more when it does not divide) or as `$VLSERVE_PP_LAYER_PARTITION` says ("10,14": 10 layers on stage 0, 14 on stage
1, as vLLM spells it). Each step stage k > 0 receives `(hidden, residual)` `[T, H]` from stage k - 1 and stage
k < last sends its own on (point to point: gloo on CPU, NCCL on CUDA; under TP x PP between the ranks of adjacent
stages that hold the same tensor-parallel shard, over `pp_group`); the last stage samples, and the other stages learn
the sampled tokens from the scheduler's next SchedulerOutput (so no stage waits for a later one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vlserve.distributed.parallel_state import pp_group, pp_info

PARTITION_ENV = "VLSERVE_PP_LAYER_PARTITION"


@dataclass
class IntermediateTensors:
    """What one stage hands the next: the residual stream as the fused norms keep it (the block output is
    `hidden + residual`)."""

    hidden: torch.Tensor  # [T, H]
    residual: torch.Tensor  # [T, H]


def layer_partition(num_layers: int, num_stages: int, spec: str | None = None) -> list[int]:
    """Layers per stage: `spec` ("a,b,..." summing to num_layers, every count >= 1; None: read
    `$VLSERVE_PP_LAYER_PARTITION`), else (empty) an even split. ValueError on a bad spec or too few layers."""
    if spec is None:
        spec = os.environ.get(PARTITION_ENV, "")
    spec = spec.strip()
    if not spec:
        if num_layers < num_stages:
            raise ValueError(f"cannot split {num_layers} decoder layers over {num_stages} pipeline stages")
        base, extra = divmod(num_layers, num_stages)
        return [base + (1 if k < extra else 0) for k in range(num_stages)]
    try:
        counts = [int(part) for part in spec.split(",")]
    except ValueError:
        raise ValueError(f"${PARTITION_ENV}={spec[:60]!r} must be comma-separated layer counts, e.g. '10,14'") from None
    if len(counts) != num_stages:
        raise ValueError(f"${PARTITION_ENV}={spec!r} has {len(counts)} stages; pipeline_parallel_size is {num_stages}")
    if any(c < 1 for c in counts):
        raise ValueError(f"${PARTITION_ENV}={spec!r}: every stage needs at least one layer")
    if sum(counts) != num_layers:
        raise ValueError(f"${PARTITION_ENV}={spec!r} sums to {sum(counts)} layers; the model has {num_layers}")
    return counts


def stage_layer_range(num_layers: int) -> tuple[int, int]:
    """`[start, end)` of the decoder layers this process's stage holds (all of them without pipeline parallelism)."""
    info = pp_info()
    if info.world_size == 1:
        return 0, num_layers
    counts = layer_partition(num_layers, info.world_size)
    start = sum(counts[: info.rank])
    return start, start + counts[info.rank]


def is_first_stage() -> bool:
    """Whether this stage holds the embeddings (and takes token ids)."""
    return pp_info().rank == 0


def is_last_stage() -> bool:
    """Whether this stage holds the final norm and the LM head (and samples)."""
    info = pp_info()
    return info.rank == info.world_size - 1


def send_intermediate(tensors: IntermediateTensors) -> None:
    """Send `(hidden, residual)` to the next stage (blocking)."""
    info = pp_info()
    dst = info.global_rank_of(info.rank + 1)
    for t in (tensors.hidden, tensors.residual):
        dist.send(t.contiguous(), dst, group=pp_group())


def recv_intermediate(
    num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
) -> IntermediateTensors:
    """Receive the previous stage's `(hidden, residual)`, each `[num_tokens, hidden_size]` (blocking)."""
    info = pp_info()
    src = info.global_rank_of(info.rank - 1)
    hidden = torch.empty((num_tokens, hidden_size), dtype=dtype, device=device)  # [T, H]
    residual = torch.empty_like(hidden)  # [T, H]
    for t in (hidden, residual):
        dist.recv(t, src, group=pp_group())
    return IntermediateTensors(hidden, residual)
