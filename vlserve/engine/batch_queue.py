"""Pipeline parallelism's batch queue (vLLM v1's `step_with_batch_queue`): up to `pipeline_parallel_size` scheduled
batches in flight, so stage 0 runs batch k + 1 while the last stage runs batch k instead of idling (the bubble).

Each step plans a batch and submits it to the executor without waiting while the queue has room and the scheduler
has work; otherwise it waits for the oldest batch, folds its output back (`Scheduler.update_from_output`) and returns
that, then refills the queue so the stages keep working while the caller processes the outputs.

A request is in at most one batch in flight: the scheduler skips `in_flight_req_ids` until its batch is folded
back, so batches hold disjoint requests and every batch is planned from known tokens (n-gram drafts, grammar
bitmasks and the tokens the non-sampling stages are sent included); one request alone runs as without the queue.
Each batch takes at most its share of the requests that can run (ceil(min(running + waiting, max_num_seqs) /
max_batches)), so decode batches stay balanced instead of the first one taking every request. A request aborted,
stopped or preempted while its batch is in flight is freed at once: its KV blocks (and encoder-cache entries) are
only reused by later batches, which every stage runs after the one in flight, and its tokens are dropped at fold (or
kept, when preempted, as under async scheduling), since the fold only reaches requests that are still the ones it
scheduled.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from vlserve.core.request import Request
from vlserve.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput


@dataclass
class InFlightBatch:
    sched_out: SchedulerOutput
    handle: Any  # the executor's, for collect_execute
    requests: dict[str, Request]  # the requests it scheduled (an id re-used after an abort is another request)


class BatchQueue:
    """The batches submitted to the executor and not yet folded back, oldest first."""

    def __init__(self, core, max_batches: int):
        self.core = core  # the EngineCore: its scheduler, executor, _schedule and _observe_timings
        self.max_batches = max_batches
        self.batches: deque[InFlightBatch] = deque()
        self.max_in_flight = 0  # the most batches with work seen in flight at once (vlserve:max_batches_in_flight)

    def __len__(self) -> int:
        return len(self.batches)

    def step(self) -> list[EngineCoreOutput]:
        """Submit a batch if there is room and work, and return at once while there is room for more; else fold the
        oldest batch back and return its outputs."""
        if len(self.batches) < self.max_batches and self.submit_next() and len(self.batches) < self.max_batches:
            return self.core.scheduler.take_failed()
        if not self.batches:
            return self.core.scheduler.take_failed()
        outputs = self.fold_oldest()
        if len(self.batches) < self.max_batches:
            self.submit_next()  # the stages work while the caller processes these outputs
        return outputs

    def submit_next(self) -> bool:
        """Plan a batch of requests not in flight and submit it; False when there was nothing to send."""
        core = self.core
        sched = core.scheduler
        active = min(len(sched.running) + len(sched.waiting), sched.config.max_num_seqs)  # those that can run
        sched_out = core._schedule(max_num_reqs=max(-(-active // self.max_batches), 1))
        if sched_out.is_empty and not sched_out.finished_req_ids and not sched_out.free_encoder_mm_hashes:
            return False
        handle = core.executor.submit_execute(sched_out)
        ids = dict.fromkeys([*sched_out.num_scheduled_tokens, *sched_out.scheduled_encoder_slices])  # (slices only too)
        self.batches.append(InFlightBatch(sched_out, handle, {rid: sched.requests[rid] for rid in ids}))
        sched.in_flight_req_ids.update(ids)
        if not sched_out.is_empty:
            core.num_steps += 1
            self.max_in_flight = max(self.max_in_flight, sum(not b.sched_out.is_empty for b in self.batches))
        return True

    def fold_oldest(self) -> list[EngineCoreOutput]:
        """Wait for the oldest batch and fold its output back into the scheduler."""
        core = self.core
        sched = core.scheduler
        batch = self.batches.popleft()
        try:
            runner_out = core.executor.collect_execute(batch.handle)
        finally:
            sched.in_flight_req_ids.difference_update(batch.requests)
        core._observe_timings(batch.sched_out, runner_out)
        return sched.update_from_output(batch.sched_out, self._still_ours(batch, runner_out))

    def _still_ours(self, batch: InFlightBatch, out: ModelRunnerOutput) -> ModelRunnerOutput:
        """The output without the rows of requests whose id now names another request (aborted, then re-added)."""
        get = self.core.scheduler.requests.get
        keep = [i for i, rid in enumerate(out.req_ids) if get(rid) is None or get(rid) is batch.requests.get(rid)]
        if len(keep) == len(out.req_ids):
            return out
        out.req_ids = [out.req_ids[i] for i in keep]
        out.sampled_token_ids = [out.sampled_token_ids[i] for i in keep]
        return out

    def drain(self) -> None:
        """Fold back every batch in flight (their requests may have finished meanwhile)."""
        while self.batches:
            self.fold_oldest()

    def discard(self) -> None:
        """At shutdown: collect what is in flight, ignoring its outputs and failures (the ranks stop next)."""
        while self.batches:
            batch = self.batches.popleft()
            self.core.scheduler.in_flight_req_ids.difference_update(batch.requests)
            try:
                self.core.executor.collect_execute(batch.handle)
            except Exception:
                self.batches.clear()
