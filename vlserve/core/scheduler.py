"""The scheduler: one rule, num_computed_tokens catches up toward the request's tokens (pure Python, no torch).

Each step it walks the running requests, then the waiting ones, giving each as many tokens as the token budget,
the KV pool and the encoder cache allow. Prefill, chunked prefill, decode, prefix hits and spec tokens all fall out
of that rule; a pooling request ends once its prompt is computed. Out of KV blocks, it preempts the most recently
admitted request. Media items are encoded within a per-step budget of embeddings (`encoder_budget`); the first item
of a step always runs, unless its tower runs in stages (`config.encoder_stage_counts`): then it is encoded a slice
of stages per step, and its request's prefill waits before it until the last slice.
"""

from __future__ import annotations

import logging

from vlserve.config import SchedulerConfig
from vlserve.core.admission import check_request
from vlserve.core.encoder_cache_manager import EncoderCacheManager
from vlserve.core.encoder_plan import NO_MEDIA, EncoderPlan, commit_encoder_inputs, plan_encoder_inputs
from vlserve.core.grammar_sync import advance_matcher, allowed_drafts, grammar_error, grammar_waiting
from vlserve.core.kv_cache_manager import KVCacheManager
from vlserve.core.kv_connector_sched import KVConnectorState
from vlserve.core.request import EngineCoreRequest, Request, RequestStatus
from vlserve.core.request_queue import new_waiting_queue
from vlserve.core.sched_output import (
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    StepPlan,
)
from vlserve.core.scheduler_checks import check_components, kv_pool_gauges
from vlserve.core.stats import SchedulerStats

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the waiting/running queues, the KV cache manager, the encoder cache manager and the KV connector's
    scheduler side (`kv_transfer`); plans steps, folds their results back and ends requests."""

    def __init__(self, config: SchedulerConfig, num_kv_blocks: int):
        self.config = config
        self.kv = KVCacheManager(
            num_kv_blocks, config.block_size, config.enable_prefix_caching, config.kv_group_windows
        )
        self.max_kv_tokens = self.kv.max_request_tokens(config.max_num_batched_tokens)  # one request, alone
        self.encoder_cache = EncoderCacheManager(config.encoder_cache_size)
        self.encoder_budget = config.encoder_compute_budget  # embeddings encoded per step
        self.encoder_slice_cap = 0  # embeddings a lone slice may take past the budget (set_encoder_budget)
        self.encoder_pack_budget = self.encoder_budget  # how far a step's later items may bring it (set_encoder_budget)
        self.requests: dict[str, Request] = {}
        self.waiting = new_waiting_queue(config.scheduling_policy)  # its order: config.scheduling_policy
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.failed: list[EngineCoreOutput] = []  # ended while waiting (a grammar or an adapter that failed)
        self.loras_loading: set[int] = set()  # adapters being loaded off the step loop: their requests wait
        # Pipeline parallel: requests of a batch in flight (not scheduled again until it is folded back; the engine's
        # batch queue keeps this set); `send_token_ids`: cached requests carry their tokens
        self.in_flight_req_ids: set[str] = set()
        self.send_token_ids = False
        self.stats = SchedulerStats()
        self.kv_transfer = KVConnectorState.from_config(config)  # external prefix blocks, parked loads, sends

    # -- admission ---------------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        """Whether a request waits, runs or waits for its KV load."""
        return bool(self.waiting or self.running or self.kv_transfer.waiting_for_kv)

    def get_num_unfinished_requests(self) -> int:
        """How many requests wait, run or wait for their KV load."""
        return len(self.waiting) + len(self.running) + len(self.kv_transfer.waiting_for_kv)

    def kv_pool_gauges(self) -> dict[str, int]:
        """`scheduler_checks.kv_pool_gauges` of this scheduler's KV pool and connector."""
        return kv_pool_gauges(self.kv, self.kv_transfer)

    def check_integrity(self) -> None:
        """`scheduler_checks.check_components` over this scheduler's parts (strict when nothing is unfinished)."""
        check_components(self.kv, self.encoder_cache, self.kv_transfer, self.requests, self.has_unfinished_requests())

    def add_request(self, engine_req: EngineCoreRequest, structured_output=None, reasoning=None) -> None:
        """Validate against the engine's limits (`admission.check_request`) and queue it. `structured_output`: the
        request's grammar matcher (compiling), when its output is constrained; `reasoning`: its ReasoningTracker."""
        rid = engine_req.request_id
        if rid in self.requests or rid in self.kv_transfer.kept_blocks:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(engine_req, check_request(self.config, engine_req, self.max_kv_tokens, len(self.waiting)))
        req.structured_output, req.reasoning = structured_output, reasoning
        # its step results need only accept_token (update_from_output's fast path): no media, grammar or pooling
        req.plain_output = not (req.mm_features or req.pools) and structured_output is None and reasoning is None
        self.stats.prompt_tokens += len(engine_req.prompt_token_ids)
        self.requests[rid] = req
        self.waiting.append(req)

    # -- scheduling --------------------------------------------------------------------------------------------
    def set_encoder_budget(self, num_embeds: int, slice_cap: int = 0, pack: int | None = None) -> None:
        """Embeddings encoded per step from the next schedule() on (the engine sizes it from measured timings), how
        many a slice of an item over the budget may take when it runs alone, and how far items after a step's first
        may bring it (`pack`, default the budget; see `plan_encoder_inputs`)."""
        if num_embeds < 1:
            raise ValueError(f"the encoder budget must be >= 1 embedding, got {num_embeds}")
        self.encoder_budget = num_embeds
        self.encoder_slice_cap = max(0, slice_cap)
        self.encoder_pack_budget = num_embeds if pack is None else max(1, min(pack, num_embeds))

    def schedule(self, max_num_reqs: int | None = None) -> SchedulerOutput:
        """Plan one step (of at most `max_num_reqs` requests: the batch queue's share of them): the running requests
        first, then the waiting ones, then the output."""
        cfg = self.config
        step = StepPlan(cfg.max_num_batched_tokens, max_num_reqs or cfg.max_num_seqs, self.send_token_ids)
        self._schedule_running(step)
        if self.waiting:  # (none in most decode steps)
            self._schedule_waiting(step)
        return self._step_output(step)

    def _schedule_running(self, step: StepPlan) -> None:
        """Give the running requests, in order, their next tokens (decodes, spec tokens, the next prefill chunk),
        preempting the last admitted ones while the KV pool has no room. Skipped: a request whose batch is in flight
        (pipeline parallel) or whose tokens in flight end it (async scheduling), one with no token to run (a slice of
        its next item's tower may still run), one whose LoRA adapter finds no room in the step."""
        cfg, running, in_flight, encoder_cache = self.config, self.running, self.in_flight_req_ids, self.encoder_cache
        max_model_len, send_token_ids = cfg.max_model_len, self.send_token_ids
        token_budget, num_encoding, max_reqs, loras = step.token_budget, step.num_encoding, step.max_reqs, step.loras
        num_scheduled, cached, spec_tokens = step.num_scheduled, step.cached_reqs, step.spec_tokens
        cached_ids, cached_blocks, cached_computed = cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        allocate_slots, num_spec, last_position = self.kv.allocate_slots, cfg.num_spec_tokens, cfg.max_model_len - 1
        for req in running:  # (preemption pops from the tail: the loop ends before the popped ones)
            if token_budget <= 0 or len(num_scheduled) >= max_reqs:
                break
            rid, placeholders = req.request_id, req.num_output_placeholders
            if (placeholders and req.finishes_in_flight(max_model_len)) or (in_flight and rid in in_flight):
                continue
            computed, num_tokens = req.num_computed_tokens, len(req.all_token_ids)
            num_new = num_tokens + len(req.spec_token_ids) + placeholders - computed
            if num_new > token_budget:
                num_new = token_budget
            if computed + num_new > last_position + req.pools:  # never past the model's length (late spec tokens
                num_new = last_position + req.pools - computed  # unverified; a pooled prompt may fill it)
            enc, num_encoding_after = NO_MEDIA, num_encoding
            if req.mm_features:
                enc, num_new, num_encoding_after = self._schedule_encoder_inputs(req, computed, num_new, num_encoding)
            if num_new <= 0 or (req.lora_request is not None and self._lora_blocked(req, loras)):
                if num_new <= 0 and enc.slices:  # only a slice of its next item's tower: no token until it is done
                    commit_encoder_inputs(encoder_cache, req, enc, step.encoder_inputs, step.encoder_slices)
                    num_encoding = num_encoding_after
                continue
            known = computed + num_new
            if known + num_spec <= req.kv_token_capacity and known <= req.kv_registered_limit:
                new_block_ids = ()  # room left in its blocks, none to register (allocate_slots' decode fast path)
            else:
                while True:
                    new_block_ids = allocate_slots(req, num_new, num_lookahead_tokens=num_spec)
                    if new_block_ids is not None:
                        break
                    victim = running.pop()
                    self._preempt(victim)
                    step.preempted = True
                    if victim is req:
                        break
                if new_block_ids is None:
                    break  # the request preempted itself
            if req.lora_request is not None and req.lora_int_id:
                loras.add(req.lora_int_id)
            if enc is not NO_MEDIA:
                commit_encoder_inputs(encoder_cache, req, enc, step.encoder_inputs, step.encoder_slices)
                num_encoding = num_encoding_after
            cached_ids.append(rid)
            cached_blocks.append(new_block_ids)
            cached_computed.append(computed)
            if send_token_ids:  # pipeline stages that do not sample: the tokens they lack, to the window's end
                start = min(computed, req.num_tokens_sent)
                cached.token_starts.append(start)
                cached.new_token_ids.append(sent := req.all_token_ids[start:known])
                req.num_tokens_sent = max(req.num_tokens_sent, start + len(sent))
            num_scheduled[rid] = num_new
            token_budget -= num_new
            if req.spec_token_ids and known > num_tokens:
                spec_tokens[rid] = req.spec_token_ids[: known - num_tokens]
            req.num_computed_tokens = known
            if known >= num_tokens + placeholders:
                req.num_output_placeholders = placeholders + 1  # this step samples; its token is known at update
        step.token_budget, step.num_encoding = token_budget, num_encoding

    def _schedule_waiting(self, step: StepPlan) -> None:
        """Admit waiting requests in order while the step has room and nothing was preempted, each from its prefix
        hit (or the tokens its finished KV load gave it); one whose prefix the KV connector can load parks in
        `kv_transfer` instead. Requests whose grammar is not ready, whose batch is in flight or whose adapter is
        loading or finds no room in the step keep their place; a failed grammar or unusable remote media ends one."""
        cfg, kv, kv_transfer = self.config, self.kv, self.kv_transfer
        load_done = kv_transfer.load_done
        if load_done:
            self.waiting = kv_transfer.resumed_first(self.waiting)
        waiting = self.waiting
        set_aside: list[Request] = []  # they keep their place
        while (
            waiting
            and not step.preempted
            and step.token_budget > 0
            and len(self.running) < cfg.max_num_seqs
            and len(step.num_scheduled) < step.max_reqs
        ):
            req = waiting[0]
            if grammar_waiting(req) or req.request_id in self.in_flight_req_ids:  # preempted while in flight
                set_aside.append(waiting.popleft())
                continue
            if grammar_error(req) is not None:
                self._abort_failed_grammar(waiting.popleft())
                continue
            if req.lora_int_id in self.loras_loading or self._lora_blocked(req, step.loras):
                set_aside.append(waiting.popleft())
                continue
            computed_blocks, num_hit, num_external = None, 0, 0
            resume = load_done.get(req.request_id) if load_done else None
            if resume is not None:  # its KV load ended: it holds its blocks, `resume` tokens of them computed
                num_hit = req.num_computed_tokens = resume
            elif req.num_computed_tokens == 0:
                computed_blocks, num_hit = kv.get_computed_blocks(req)
                num_external = kv_transfer.num_external_tokens(req, num_hit)
            if num_external:
                if not kv_transfer.start_load(req, kv, computed_blocks, num_hit, num_external):
                    break
                waiting.popleft()
                continue
            num_new = min(req.num_tokens - num_hit, step.token_budget)
            enc, num_new, num_encoding_after = self._schedule_encoder_inputs(req, num_hit, num_new, step.num_encoding)
            if enc.reads_remote_media(req.mm_features):  # the producer's KV did not come (or was evicted)
                self._fail_remote_media(req)  # no media to encode
                continue
            if num_new <= 0 and not enc.slices:  # (with a slice to run it is admitted with no token this step)
                break
            lookahead = cfg.num_spec_tokens if num_hit + num_new >= req.num_tokens else 0
            new_block_ids = kv.allocate_slots(req, num_new, computed_blocks, num_lookahead_tokens=lookahead)
            if (
                new_block_ids is None
                and resume is not None
                and not step.num_scheduled
                and not self.running
                and kv_transfer.release_parked(req, self.requests, kv)
            ):
                new_block_ids = kv.allocate_slots(req, num_new, None, num_lookahead_tokens=lookahead)
            if new_block_ids is None:
                break
            step.num_encoding = num_encoding_after
            waiting.popleft()
            if resume is not None:
                del load_done[req.request_id]
            self._admit(req, num_hit, num_new, enc, step)
        if set_aside:
            waiting.extendleft(reversed(set_aside))

    def _admit(self, req: Request, num_hit: int, num_new: int, enc: EncoderPlan, step: StepPlan) -> None:
        """Start a waiting request that got its blocks: `num_hit` tokens computed, `num_new` scheduled this step."""
        if req.lora_int_id:
            step.loras.add(req.lora_int_id)
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        req.status = RequestStatus.RUNNING
        self.waiting.add_running(self.running, req)  # where the policy wants it (the tail is preempted first)
        commit_encoder_inputs(self.encoder_cache, req, enc, step.encoder_inputs, step.encoder_slices)
        req.num_tokens_sent = req.num_tokens
        step.new_reqs.append(
            NewRequestData(
                req.request_id,
                req.prompt_token_ids,
                list(req.output_token_ids),
                req.sampling_params,
                req.mm_features,
                self.kv.get_block_ids(req.request_id),
                num_hit,
                req.lora_request,
            )
        )
        if num_new:
            step.num_scheduled[req.request_id] = num_new
            step.token_budget -= num_new
            req.num_computed_tokens = num_hit + num_new
            if req.num_computed_tokens >= len(req.all_token_ids) + req.num_output_placeholders:
                req.num_output_placeholders += 1  # this step samples; its token is known at update

    def _step_output(self, step: StepPlan) -> SchedulerOutput:
        """Assemble the step's SchedulerOutput (with the connector's plan); the scheduled requests' computed tokens
        were advanced as they were planned (a window reaching its last token adds an output placeholder)."""
        num_scheduled = step.num_scheduled
        out = SchedulerOutput(
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=step.cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens=step.spec_tokens,
            scheduled_encoder_inputs=step.encoder_inputs,
            finished_req_ids=self.finished_req_ids,
            free_encoder_mm_hashes=self.encoder_cache.get_freed_mm_hashes(),
            scheduled_encoder_slices=step.encoder_slices,
        )
        connector = self.kv_transfer.connector
        if connector is not None:
            out.kv_connector_metadata = connector.build_connector_meta(out, self)
        self.finished_req_ids = set()
        return out

    def _lora_blocked(self, req: Request, loras: set[int]) -> bool:
        """Whether req's adapter would be one more than max_loras distinct adapters in this step (base: never)."""
        lora_id = req.lora_int_id
        return bool(lora_id) and lora_id not in loras and len(loras) >= self.config.max_loras

    def _schedule_encoder_inputs(
        self, req: Request, start: int, num_new: int, num_encoding: int
    ) -> tuple[EncoderPlan, int, int]:
        """Plan the media items the token window [start, start + num_new) reaches (see `plan_encoder_inputs`; the
        items of a request with a LoRA adapter are never split: its tower weights may differ)."""
        if not req.mm_features:
            return NO_MEDIA, num_new, num_encoding
        stage_counts = None if req.lora_int_id else self.config.encoder_stage_counts
        return plan_encoder_inputs(
            req.mm_features,
            self.encoder_cache,
            self.encoder_budget,
            start,
            num_new,
            num_encoding,
            self.config.disable_chunked_mm_input,
            stage_counts,
            req.request_id,
            self.encoder_slice_cap,
            self.encoder_pack_budget,
        )

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self.encoder_cache.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.finished_req_ids.add(req.request_id)  # the runner drops its state; it comes back as a new request
        self.waiting.appendleft(req)

    # -- results -----------------------------------------------------------------------------------------------
    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, roll back rejected spec tokens, drop finished encoder refs, detect stops."""
        outputs, self.failed = self.failed, []
        kv_transfer = self.kv_transfer
        if runner_out.kv_connector_output is not None and kv_transfer.connector is not None:
            # loads that ended: their requests go back to the head of the queue
            self.waiting.extendleft(kv_transfer.update_from_output(runner_out.kv_connector_output, self.kv))
        finished: list[tuple[Request, bool]] = []  # (request, was running)
        get_request, spec_scheduled = self.requests.get, sched_out.scheduled_spec_decode_tokens
        spec_next, logprobs, prompt_lps = runner_out.spec_token_ids, runner_out.logprobs, runner_out.prompt_logprobs
        RUNNING, FIRST_FINISHED = RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED
        max_model_len = self.config.max_model_len
        num_generated = 0
        plain_step = not (spec_scheduled or spec_next or logprobs or prompt_lps)
        for rid, sampled in zip(runner_out.req_ids, runner_out.sampled_token_ids):
            req = get_request(rid)
            if req is None or req.status >= FIRST_FINISHED:
                continue
            if plain_step and len(sampled) == 1 and req.plain_output and not req.spec_token_ids:  # the usual decode
                if req.num_output_placeholders:
                    req.num_output_placeholders -= 1
                status = req.status
                num_generated += 1
                if req.accept_token(sampled[0], max_model_len):
                    finished.append((req, status == RUNNING))
                    reason = req.status.finish_reason
                else:
                    reason = None
                # (`sampled`: the runner's list for this request alone; num_cached_tokens: set when it was admitted)
                outputs.append(EngineCoreOutput(rid, sampled, reason, req.stop_reason, None, req.num_cached_tokens))
                continue
            if sampled and req.num_output_placeholders:
                req.num_output_placeholders -= 1
            # Not running: preempted while its step was in flight (async scheduling). Its tokens still count;
            # its computed tokens and encoder references were already reset.
            running = req.status == RUNNING
            scheduled_spec = spec_scheduled.get(rid) if running and spec_scheduled else None
            if scheduled_spec:
                # sampled = accepted drafts + one target token; the rest of the drafts were rejected.
                req.num_computed_tokens -= len(scheduled_spec) + 1 - len(sampled)  # the rejected drafts
                self.stats.count_drafts(len(scheduled_spec), len(sampled) - 1)
            if running and req.mm_features:
                self.encoder_cache.release_written(req.request_id, req.mm_features, req.num_computed_tokens)
            new_tokens = req.accept_sampled(sampled, max_model_len) if sampled else []
            if req.pools and req.num_computed_tokens >= req.num_prompt_tokens:  # pooled: ends with its prompt
                req.status = FIRST_FINISHED
            if req.structured_output is not None or req.reasoning is not None:
                advance_matcher(req, new_tokens)
            is_finished = req.status >= FIRST_FINISHED
            if req.spec_token_ids or spec_next:
                req.spec_token_ids = allowed_drafts(req, spec_next.get(rid, [])) if running and not is_finished else []
            if not new_tokens and not is_finished:
                continue
            num_generated += len(new_tokens)
            lps = logprobs.get(rid) if logprobs else None
            outputs.append(
                EngineCoreOutput(
                    rid,
                    new_tokens,
                    req.status.finish_reason if is_finished else None,
                    req.stop_reason,
                    lps[: len(new_tokens)] if lps else None,
                    max(req.num_cached_tokens, 0),
                    prompt_logprobs=prompt_lps.get(rid) if prompt_lps else None,
                    pooling_output=runner_out.pooler_output.get(rid) if req.pools else None,
                )
            )
            if is_finished:
                finished.append((req, running))
        self.stats.generation_tokens += num_generated
        if finished:
            done = {id(req) for req, running in finished if running}
            if done:
                self.running = [r for r in self.running if id(r) not in done]
            for req, running in finished:
                if not kv_transfer.drop(req.request_id) and not running:  # (a parked request is in no queue)
                    self.waiting.remove(req)
                params = self._free_request(req)
                if params is not None:
                    outputs[
                        -1 - next(i for i, o in enumerate(reversed(outputs)) if o.request_id == req.request_id)
                    ].kv_transfer_params = params
        return outputs

    # -- ending requests ---------------------------------------------------------------------------------------
    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Finish these requests now; returns the ids that were still alive."""
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            parked = self.kv_transfer.drop(rid)
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif not parked:
                self.waiting.remove(req)
            req.status = RequestStatus.FINISHED_ABORTED
            self._free_request(req)
            aborted.append(rid)
        return aborted

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Finish requests from outside (stop strings found by the detokenizer)."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            (self.running if req.status == RequestStatus.RUNNING else self.waiting).remove(req)
            req.status = status
            self._free_request(req)

    def take_failed(self) -> list[EngineCoreOutput]:
        """The requests that ended while waiting since the last step's results (reported with the next ones)."""
        failed, self.failed = self.failed, []
        return failed

    def fail_lora(self, lora_int_id: int, error: str) -> None:
        """The adapter failed to load: its waiting requests end "abort" with the error."""
        self.loras_loading.discard(lora_int_id)
        for req in [r for r in self.waiting if r.lora_int_id == lora_int_id]:
            self.waiting.remove(req)
            self._fail_waiting(req, f"its LoRA adapter did not load: {error}", error)

    def _abort_failed_grammar(self, req: Request) -> None:
        """A request whose grammar did not compile ends "abort" (the front end validates first, so this is rare)."""
        error = grammar_error(req)
        self._fail_waiting(req, f"its grammar did not compile: {error}", error)

    def _fail_remote_media(self, req: Request) -> None:
        """A disaggregated consumer's request (the waiting queue's head) that must recompute a media item its
        producer encoded (the KV read failed, or its blocks were evicted since): it has no media, so it ends "abort"
        with the error."""
        self.waiting.popleft()
        self.kv_transfer.drop(req.request_id)
        error = (
            "the producer's KV for this request's media could not be used and the decode server has no media "
            "to encode; send the request again"
        )
        self._fail_waiting(req, error, error)

    def _fail_waiting(self, req: Request, message: str, error: str) -> None:
        """End a request taken off the waiting queue "abort" with `error` (reported with the next step's results)."""
        req.status = RequestStatus.FINISHED_ABORTED
        logger.error("request %s: %s", req.request_id, message)
        self.failed.append(EngineCoreOutput(req.request_id, [], "abort", extra={"error": error}))
        self._free_request(req)

    def _free_request(self, req: Request) -> dict | None:
        """Free a finished request's encoder references and KV blocks (unless the KV connector keeps them until
        they are sent, see `KVConnectorState.release_blocks`); returns the connector's kv_transfer_params or None."""
        params = self.kv_transfer.release_blocks(req, self.kv)
        self.encoder_cache.free(req.request_id)
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]
        return params
