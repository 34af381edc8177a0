"""Which executor runs the ranks: in process, worker processes or Ray actors."""

from __future__ import annotations

from vlserve.executor.base import Executor
from vlserve.executor.uniproc import UniprocExecutor
from vlserve.executor.worker import RankModel, WorkerSettings


def build_executor(settings: WorkerSettings, rank_model: RankModel | None = None) -> Executor:
    """The executor `settings.args` asks for: in process (one rank, no backend named; needs
    `rank_model`), worker processes ("mp", the default above one rank) or Ray actors ("ray")."""
    args = settings.args
    backend = args.distributed_executor_backend
    if backend is None:
        backend = "uni" if args.world_size == 1 else "mp"
    if backend == "uni":
        if rank_model is None:
            raise ValueError("the in-process executor needs the loaded model")
        return UniprocExecutor(settings, rank_model)
    if backend == "mp":
        from vlserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(settings)
    from vlserve.executor.ray_executor import RayExecutor

    return RayExecutor(settings)
