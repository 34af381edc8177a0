"""The executor interface the engine core drives."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any

import torch

from vlserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from vlserve.executor.worker import WorkerStats


class WorkerDied(RuntimeError):
    """A rank's process (or Ray actor) is gone: the requests in flight cannot finish and the engine must stop."""


class Executor(ABC):
    """Runs each planned step on every rank and returns the sampled tokens (rank 0's; under pipeline parallelism the
    last stage's).

    Built whole: the constructor loads the ranks, agrees on the KV block count (`num_blocks`, the smallest any rank
    can hold) and allocates the caches. Called from one thread at a time.
    """

    num_blocks: int
    device: torch.device
    runner: Any = None  # the ModelRunner when it lives in this process (tests and benches reach into it)

    @abstractmethod
    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; the sampling rank's output."""

    def submit_execute(self, sched_out: SchedulerOutput) -> Any:
        """Start a step without waiting for it; `collect_execute(handle)` returns its output. Steps are collected in
        the order they were submitted (here: run at once; ranks elsewhere queue them). Pipeline parallelism's batch
        queue and async scheduling keep steps in flight this way."""
        return self.execute_model(sched_out)

    def collect_execute(self, handle: Any) -> ModelRunnerOutput:
        """The output of the oldest step submitted and not yet collected (`handle` is what submit returned)."""
        return handle

    @abstractmethod
    def collective_rpc(self, method: str, arg=None) -> list:
        """Call `Worker.<method>(arg)` on every rank; the results in rank order (plain data)."""

    @abstractmethod
    def stats(self) -> WorkerStats:
        """The sampling rank's counters after the latest step."""

    def shutdown(self) -> None:  # noqa: B027  (optional: most executors have nothing to stop)
        """Stop the ranks (no-op in process)."""


class RankGroupExecutor(Executor):
    """An executor whose ranks run elsewhere (processes, actors): the output rank's output (rank 0, or the last
    pipeline stage's first rank: the one that samples), the ranks checked against it, and one failure ends the
    group. Subclasses set up `_dead = None`, `_stats = WorkerStats()` and implement `_submit` / `_collect_call` (a
    call sent to every rank, its answers gathered later: each rank runs its calls in order, so several steps can be
    in flight, stage 0 running step k + 1 while the last stage runs step k) and `_stop_ranks`."""

    world_size: int
    tp_size: int = 1
    pp_size: int = 1
    output_rank: int = 0  # whose ModelRunnerOutput is the step's (the last pipeline stage's first rank)
    _dead: str | None = None  # why the ranks can no longer run steps
    _stats: WorkerStats = WorkerStats()

    @abstractmethod
    def _submit(self, method: str, arg=None) -> Any:
        """Send `Worker.<method>(arg)` to every rank without waiting; a handle for `_collect_call`."""

    @abstractmethod
    def _collect_call(self, handle: Any, method: str) -> list:
        """Every rank's answer to the submitted call, in rank order; WorkerDied (naming the rank) on a death."""

    def collective_rpc(self, method: str, arg=None) -> list:
        """Send one call to every rank; every rank's result, in rank order (no step may be in flight)."""
        if self._dead:
            raise WorkerDied(self._dead)
        return self._collect_call(self._submit(method, arg), method)

    @abstractmethod
    def _stop_ranks(self) -> None:
        """Stop every rank now (some may be blocked in a collective with a lost one)."""

    def _size_and_allocate_caches(self) -> None:
        """Agree on the KV block count (the smallest any rank holds; CPU ranks share one host's RAM) and allocate."""
        share = 1.0 / self.world_size if self.device.type == "cpu" else 1.0
        self.num_blocks = min(self.collective_rpc("determine_num_blocks", share))
        self.collective_rpc("initialize", self.num_blocks)

    def _rank_name(self, rank: int) -> str:
        """How errors name a rank: "tensor-parallel rank 1", or "rank 3 (pipeline stage 1)"."""
        if self.pp_size == 1:
            return f"tensor-parallel rank {rank}"
        return f"rank {rank} (pipeline stage {rank // self.tp_size})"

    def _fail(self, why: str):
        self._dead = why
        self._stop_ranks()
        raise WorkerDied(why)

    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect_execute(self.submit_execute(sched_out))

    def submit_execute(self, sched_out: SchedulerOutput) -> Any:
        if self._dead:
            raise WorkerDied(self._dead)
        return self._submit("execute_model", sched_out)

    def collect_execute(self, handle: Any) -> ModelRunnerOutput:
        results = self._collect_call(handle, "execute_model")
        ref = self.output_rank
        output, self._stats = results[ref]
        if ref != 0:  # pipeline stages: the first one runs the encoders, so its encoder counters are the step's
            first, first_stats = results[0]
            output.encoder_seconds, output.num_encoded_embeds = first.encoder_seconds, first.num_encoded_embeds
            self._stats = replace(
                self._stats,
                num_encoder_runs=first_stats.num_encoder_runs,
                encoder_runs_by_modality=first_stats.encoder_runs_by_modality,
            )
        for rank in range(ref + 1, ref + self.tp_size):  # the sampling stage's ranks (the others sample nothing)
            other = results[rank][0]
            if other.sampled_token_ids != output.sampled_token_ids:
                self._fail(
                    f"rank {rank} sampled {other.sampled_token_ids} where rank {ref} sampled "
                    f"{output.sampled_token_ids}: the ranks diverged"
                )
        return output

    def stats(self) -> WorkerStats:
        return self._stats
