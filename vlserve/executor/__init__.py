"""Executors: where the ranks of the model run (this process, worker processes, or Ray actors) and how each step's
SchedulerOutput reaches them. The engine core talks to one `Executor`, whatever its kind."""

from vlserve.executor.base import Executor, WorkerDied
from vlserve.executor.factory import build_executor

__all__ = ["Executor", "WorkerDied", "build_executor"]
