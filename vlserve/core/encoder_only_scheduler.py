"""The scheduler of an encode server (E/PD disaggregation, `mm_encoder_only`; pure Python, no torch).

A request's prompt is walked as by the full scheduler, but no token is computed and no KV block is held: each step
a running request's window goes from where it stands to the end of the prompt, cut before the first media item the
step's encoder budget or the encoder cache cannot take (`plan_encoder_inputs`); the items in the window are encoded
(and published by the runner's encoder-cache connector). When the window reaches the end of the prompt the request
ends "length" with no tokens: what the client (the `vlserve proxy --encode` stage) reads as "encoded". A text-only
request ends so at its first step. Windows end at an item's start, so after each step every item a request
referenced is released: nothing holds the encoder cache between steps.
"""

from __future__ import annotations

from dataclasses import replace

from vlserve.config import SchedulerConfig
from vlserve.core.encoder_plan import commit_encoder_inputs, plan_encoder_inputs
from vlserve.core.request import RequestStatus
from vlserve.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from vlserve.core.scheduler import Scheduler

ENCODED_FINISH_REASON = "length"  # an encode server's requests end so, with no tokens


class EncoderOnlyScheduler(Scheduler):
    """Plans only encoder work; admission checks, aborts, the encoder cache and the counters are the Scheduler's.
    Its KV cache manager holds one block that no request ever takes (the runner allocates no KV tensors)."""

    def __init__(self, config: SchedulerConfig, num_kv_blocks: int = 0):
        if config.kv_transfer_config is not None:
            raise ValueError("an encode server (mm_encoder_only) takes no kv_transfer_config")
        super().__init__(replace(config, kv_group_windows=(None,)), 1)
        self.max_kv_tokens = config.max_model_len  # no KV is held: only max_model_len bounds a prompt
        self.runner_req_ids: set[str] = set()  # requests the runner was sent (as new requests)

    def schedule(self, max_num_reqs: int | None = None) -> SchedulerOutput:
        """Admit waiting requests (up to max_num_seqs running) and give each running one its next window."""
        cfg = self.config
        self.runner_req_ids -= self.finished_req_ids
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            req = self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = 0
            self.running.append(req)
        num_encoding = 0  # embeddings this step encodes so far
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs = CachedRequestData()
        encoder_inputs: dict[str, list[int]] = {}
        for req in self.running[: max_num_reqs or cfg.max_num_seqs]:
            start = req.num_computed_tokens
            plan, num_new, num_encoding_after = plan_encoder_inputs(
                req.mm_features,
                self.encoder_cache,
                self.encoder_budget,
                start,
                req.num_tokens - start,
                num_encoding,
                cfg.disable_chunked_mm_input,
            )
            if num_new <= 0:
                continue  # its next item waits for room in the encoder cache or the step's budget
            num_encoding = num_encoding_after
            commit_encoder_inputs(self.encoder_cache, req, plan, encoder_inputs, {})  # (no stage counts: no slice)
            rid = req.request_id
            if rid in self.runner_req_ids:
                cached_reqs.add(rid, (), start)
            else:
                self.runner_req_ids.add(rid)
                new_reqs.append(
                    NewRequestData(
                        rid,
                        req.prompt_token_ids,
                        [],
                        req.sampling_params,
                        req.mm_features,
                        ([],),
                        start,
                        req.lora_request,
                    )
                )
            num_scheduled[rid] = num_new
            req.num_computed_tokens = start + num_new
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_encoder_inputs=encoder_inputs,
            finished_req_ids=self.finished_req_ids,
            free_encoder_mm_hashes=self.encoder_cache.get_freed_mm_hashes(),
        )
        self.finished_req_ids = set()
        return out

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Release the items the step encoded; a request whose window reached its prompt's end ends "length" with
        no tokens."""
        outputs, self.failed = self.failed, []
        done = []
        for rid in sched_out.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted meanwhile
            self.encoder_cache.release_written(req.request_id, req.mm_features, req.num_computed_tokens)
            if req.num_computed_tokens >= req.num_tokens:
                req.status = RequestStatus.FINISHED_LENGTH
                outputs.append(EngineCoreOutput(rid, [], ENCODED_FINISH_REASON, num_cached_tokens=0))
                done.append(req)
        if done:
            ended = {id(r) for r in done}
            self.running = [r for r in self.running if id(r) not in ended]
            for req in done:
                self._free_request(req)
        return outputs
