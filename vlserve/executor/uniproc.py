"""The in-process executor: one rank, the whole model, in the engine's own process."""

from __future__ import annotations

from vlserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from vlserve.executor.base import Executor
from vlserve.executor.worker import RankModel, Worker, WorkerSettings, WorkerStats
from vlserve.worker.deferred_samples import StepHandle


class UniprocExecutor(Executor):
    """One rank, the whole model, in this process (the default for tensor_parallel_size 1)."""

    def __init__(self, settings: WorkerSettings, rank_model: RankModel):
        self.worker = Worker(settings, rank_model)
        self.runner = self.worker.runner
        self.device = rank_model.device
        self.num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize(self.num_blocks)

    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched_out)

    def submit_execute(self, sched_out: SchedulerOutput) -> StepHandle:
        """Run the step here; under async scheduling it returns with its sampled ids still on the device."""
        return self.worker.launch_step(sched_out)

    def collect_execute(self, handle: StepHandle) -> ModelRunnerOutput:
        return handle.output()

    def collective_rpc(self, method: str, arg=None) -> list:
        return [getattr(self.worker, method)(arg)]

    def stats(self) -> WorkerStats:
        return self.worker.stats()
