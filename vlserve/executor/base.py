"""The executor interface the engine core drives."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from vlserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from vlserve.executor.worker import WorkerStats


class WorkerDied(RuntimeError):
    """A rank's process (or Ray actor) is gone: the requests in flight cannot finish and the engine must stop."""


class Executor(ABC):
    """Runs each planned step on every rank and returns rank 0's sampled tokens.

    Built whole: the constructor loads the ranks, agrees on the KV block count (`num_blocks`, the smallest any rank
    can hold) and allocates the caches. Called from one thread at a time.
    """

    num_blocks: int
    device: torch.device
    runner: Any = None  # the ModelRunner when it lives in this process (tests and benches reach into it)

    @abstractmethod
    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0's output."""

    @abstractmethod
    def collective_rpc(self, method: str, arg=None) -> list:
        """Call `Worker.<method>(arg)` on every rank; the results in rank order (plain data)."""

    @abstractmethod
    def stats(self) -> WorkerStats:
        """Rank 0's counters after the latest step."""

    def shutdown(self) -> None:
        """Stop the ranks (no-op in process)."""
