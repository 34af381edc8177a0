"""EngineCore: schedule -> execute -> update, one step at a time. Front ends (LLM, AsyncLLM) drive it."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import numpy as np
import torch

from vlserve.config import EngineArgs, SchedulerConfig, resolve_model_path
from vlserve.core.encoder_budget import EncoderBudget
from vlserve.core.encoder_only_scheduler import EncoderOnlyScheduler
from vlserve.core.grammar_sync import apply_reasoning_rows, bitmask_rows
from vlserve.core.kv_cache_groups import group_layers
from vlserve.core.request import EngineCoreRequest, RequestStatus
from vlserve.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from vlserve.core.scheduler import Scheduler
from vlserve.engine.batch_queue import BatchQueue
from vlserve.engine.kv_transfer_setup import check_kv_transfer, resolve_ec_transfer, resolve_kv_transfer
from vlserve.engine.lora_loads import LoRALoads
from vlserve.engine.model_setup import LoadedModel, load_for_serving
from vlserve.engine.pooling import pooling_engine_args, resolve_pooler_spec
from vlserve.executor import build_executor
from vlserve.executor.worker import RankModel, WorkerSettings
from vlserve.models.capabilities import model_capabilities
from vlserve.models.hf_config import layer_windows_of, text_config_of
from vlserve.models.registry import get_model_class
from vlserve.reasoning import ReasoningTracker, get_reasoning_parser
from vlserve.spec_decode import SpeculativeConfig
from vlserve.spec_decode.config import fill_default_draft

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler (pure Python) and the model runner (tensors); knows nothing of text or HTTP."""

    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None, processor: bool = True):
        check_kv_transfer(args)  # before loading anything: an unknown connector is a ValueError at once
        sharded = args.world_size > 1 or args.distributed_executor_backend not in (None, "uni")
        if loaded is None:  # the ranks load their own shards when they run elsewhere; `processor`: see load_for_serving
            loaded = load_for_serving(
                resolve_model_path(args.model), args, build_model=not sharded, processor=processor
            )
        self.loaded = loaded
        args = resolve_kv_transfer(args, loaded)  # the connector checked, the offloading tier sized and keyed
        args = resolve_ec_transfer(args, loaded)  # the encoder-cache connector's namespace
        # a pooling engine's pooler (engine/pooling.py), None when it generates
        self.pooler_spec = resolve_pooler_spec(args, loaded.hf_config, loaded.tokenizer, loaded.model_path)
        # what the model offers (the API reads `model_capabilities.dual_tower`: one text or one image per request)
        self.model_capabilities = caps = model_capabilities(get_model_class(loaded.hf_config), loaded.hf_config)
        args = pooling_engine_args(args, self.pooler_spec, caps.kv_free)
        self.max_model_len = loaded.max_model_len
        # `{"method": "eagle"}` with no draft on the demo model: its shipped head
        self.spec_config = SpeculativeConfig.from_dict(fill_default_draft(args.speculative_config, loaded.model_path))
        max_batched = args.max_num_batched_tokens or max(2048, min(self.max_model_len, 8192))
        settings = WorkerSettings(
            args, loaded.model_path, self.max_model_len, max_batched, self.spec_config, self.pooler_spec
        )
        rank_model = (
            None
            if loaded.model is None
            else RankModel(
                loaded.model_path,
                loaded.hf_config,
                loaded.model,
                loaded.device,
                loaded.dtype,
                loaded.mrope_positions_fn,
            )
        )
        self.executor = build_executor(settings, rank_model)
        self.runner = self.executor.runner  # the ModelRunner when it runs in this process, else None
        num_blocks = self.executor.num_blocks
        enc_size = args.encoder_cache_size or max(8192, max_batched)
        # Embeddings encoded per step: the user's number, else about max(one decode step, encoder_step_ms) of time
        # (measured as it runs). An encode server has no decode steps to keep short: the user's, else the cache.
        self.encoder_budget = EncoderBudget(
            args.max_num_encoder_input_tokens or (enc_size if args.mm_encoder_only else None),
            min_step_seconds=args.encoder_step_ms / 1000.0,
        )
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=self.max_model_len,
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            encoder_cache_size=enc_size,
            encoder_compute_budget=self.encoder_budget.budget,
            num_spec_tokens=self.spec_config.num_speculative_tokens if self.spec_config else 0,
            max_waiting_requests=args.max_waiting_requests,
            scheduling_policy=args.scheduling_policy,
            disable_chunked_mm_input=caps.unsplit_mm_items,
            # towers that run a slice of their blocks per step (an item over the budget is split across steps)
            encoder_stage_counts=dict(caps.encoder_stage_counts),
            kv_group_windows=group_layers(layer_windows_of(text_config_of(loaded.hf_config))).windows,
            max_loras=args.max_loras if args.enable_lora else 0,
            kv_transfer_config=args.kv_transfer_config,
        )
        self.enable_lora = args.enable_lora
        # an encode server (mm_encoder_only): plans encoder work only, ends requests with no tokens
        self.scheduler = (EncoderOnlyScheduler if args.mm_encoder_only else Scheduler)(
            self.scheduler_config, num_blocks
        )
        # the adapters registered on every rank, and those loading there off the step loop
        self.loras = LoRALoads(self.executor, self.scheduler, args.max_lora_rank)
        self.structured_outputs_config = args.structured_outputs_config
        self._structured_output_manager = None  # built on the first constrained request
        # the reasoning tags' ids (--reasoning-parser): grammars start after the end tag, budgets force it
        self.reasoning_tokens = (
            None
            if args.reasoning_parser is None
            else get_reasoning_parser(args.reasoning_parser)(loaded.tokenizer).token_ids()
        )
        self.num_steps = 0
        # Async scheduling: submitted steps not yet folded back, oldest first, with the executor's handle for
        # `collect_execute` (None when synchronous).
        self.steps_in_flight: deque[tuple[SchedulerOutput, Any]] | None = deque() if args.async_scheduling else None
        # Pipeline parallel: up to one batch per stage in flight (batch_queue.py); the stages that do not sample
        # learn the tokens from the SchedulerOutputs. None: one step at a time.
        pp = args.pipeline_parallel_size
        self.scheduler.send_token_ids = pp > 1
        self.batch_queue = BatchQueue(self, pp) if pp > 1 else None

    # -- requests ----------------------------------------------------------------------------------------------
    @property
    def runner_type(self) -> str:
        """ "pooling" when the runner pools prompts (`pooler_spec`), else "generate"."""
        return "generate" if self.pooler_spec is None else "pooling"

    @property
    def pooling_tasks(self) -> set[str]:
        """The PoolingParams tasks this engine serves (none when it generates)."""
        return set() if self.pooler_spec is None else self.pooler_spec.supported_tasks

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request (ValueError if it can never run); a constrained one starts compiling its grammar."""
        if request.pools != (self.pooler_spec is not None):
            raise ValueError(
                "this engine pools (runner='pooling'): use embed / classify / score / encode, not generation"
                if self.pooler_spec is not None
                else "this engine generates text; pooling requests need runner='pooling' (--runner pooling)"
            )
        if request.lora_request is not None:  # a new adapter loads off the step loop; the request waits for it
            self._check_lora_on()
            self.loras.begin(request.lora_request)
        constraint = request.sampling_params.structured_outputs
        reasoning = self._reasoning_tracker(request)
        matcher = None if constraint is None else self.structured_output_manager.init_request(constraint)
        self.scheduler.add_request(request, matcher, reasoning)

    def _reasoning_tracker(self, request: EngineCoreRequest) -> ReasoningTracker | None:
        """Where the request's reasoning ends, when that matters: it has a grammar or a thinking budget and the
        engine has a reasoning parser (a budget without one is a ValueError)."""
        budget = request.sampling_params.thinking_token_budget
        if self.reasoning_tokens is None:
            if budget is not None:
                raise ValueError(
                    "thinking_token_budget needs a reasoning parser (reasoning_parser, --reasoning-parser)"
                )
            return None
        if budget is None and request.sampling_params.structured_outputs is None:
            return None
        return ReasoningTracker(self.reasoning_tokens, request.prompt_token_ids, budget)

    # -- LoRA adapters -----------------------------------------------------------------------------------------
    def add_lora(self, lora_request) -> bool:
        """Load a LoRA adapter on every rank and wait for it (ValueError: LoRA off, a bad adapter, or its id taken by
        another adapter); False when it was registered already. Steps run while it loads only through
        `add_lora_async`."""
        self._check_lora_on()
        if not self.loras.begin(lora_request):
            return False
        error = self.loras.wait(lora_request.lora_int_id)
        if error is not None:
            raise ValueError(error)
        return True

    def add_lora_async(self, lora_request, on_done) -> None:
        """Start loading a LoRA adapter on every rank; `on_done(error, result)` fires between steps once it is
        registered (result True; False when it was already) or failed (a ValueError), or at once on a quick-check
        error. The engine loop keeps stepping meanwhile."""
        try:
            self._check_lora_on()
            self.loras.begin(lora_request, on_done)
        except Exception as e:
            on_done(e, None)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (its host copy and device slot, or its load under way); False if unknown. Requests
        still running with it reload it from its path."""
        return self.loras.remove(lora_int_id)

    def evict_encoder_items(self, mm_hashes: list[str]) -> int:
        """Drop these items' cached embeddings where no request references them; returns how many were dropped."""
        return self.scheduler.encoder_cache.evict(mm_hashes)

    def list_loras(self) -> list[int]:
        """The registered adapters' ids."""
        return sorted(self.loras.registered)

    def _check_lora_on(self) -> None:
        if not self.enable_lora:
            raise ValueError("this request names a LoRA adapter but the engine runs without LoRA (enable_lora)")

    @property
    def structured_output_manager(self):
        """Compiles grammars (off the step loop) and fills token bitmasks; built on first use."""
        if self._structured_output_manager is None:
            from vlserve.structured_output.manager import StructuredOutputManager  # xgrammar: only when used

            loaded = self.loaded
            self._structured_output_manager = StructuredOutputManager(
                loaded.tokenizer,
                loaded.hf_config.get_text_config().vocab_size,
                self.structured_outputs_config,
                stop_token_ids=loaded.eos_token_ids,
            )
        return self._structured_output_manager

    def _schedule(self, max_num_reqs: int | None = None) -> SchedulerOutput:
        """Plan a step; constrained requests that sample in it get their rows of the token bitmask."""
        sched_out = self.scheduler.schedule(max_num_reqs)
        manager = self._structured_output_manager
        if (manager is not None or self.reasoning_tokens is not None) and not sched_out.is_empty:
            rows = bitmask_rows(
                self.scheduler.requests, sched_out.num_scheduled_tokens, sched_out.scheduled_spec_decode_tokens
            )
            if rows.num_rows:
                if any(m is not None for m in rows.matchers):
                    bitmask = manager.grammar_bitmask(rows.matchers, rows.drafts)
                else:  # only reasoning rows: all tokens allowed, then the forced ones
                    words = (self.loaded.hf_config.get_text_config().vocab_size + 31) // 32
                    bitmask = np.full((rows.num_rows, words), -1, dtype=np.int32)
                sched_out.grammar_bitmask = apply_reasoning_rows(bitmask, rows.force_only, rows.also_allow)
                sched_out.grammar_rows = rows.first_row
        return sched_out

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)
        self._flush_if_idle()

    def finish_requests_stopped(self, request_ids: list[str]) -> None:
        """Requests the detokenizer stopped on a stop string."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)
        self._flush_if_idle()

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running, or adapter loads to poll."""
        return self.scheduler.has_unfinished_requests() or bool(self.loras.loading)

    def has_kept_kv_blocks(self) -> bool:
        """Finished requests whose blocks the KV connector keeps (a P2P producer's, until the consumer confirms its
        read or the send times out): an idle engine keeps stepping every `KV_POLL_S` while there are any, so its
        worker can report them sent and they are freed."""
        return bool(self.scheduler.kv_transfer.kept_blocks)

    # -- the loop ----------------------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model, and fold the results back; returns per-request new tokens."""
        self.loras.poll()  # adapters that finished loading let their requests in (or fail them)
        if self.steps_in_flight is not None:
            return self._step_async()
        if self.batch_queue is not None:
            outputs = self.batch_queue.step()
            self._flush_if_idle()
            return outputs
        sched_out = self._schedule()
        if sched_out.is_empty and not sched_out.finished_req_ids and sched_out.kv_connector_metadata is None:
            if self.loras.loading:
                time.sleep(0.002)  # nothing runs until a load ends: leave the cores to the loading thread
            return self.scheduler.take_failed()
        runner_out = self.executor.execute_model(sched_out)
        self.num_steps += 1
        self._observe_timings(sched_out, runner_out)
        outputs = self.scheduler.update_from_output(sched_out, runner_out)
        self._flush_if_idle()
        return outputs

    def _step_async(self) -> list[EngineCoreOutput]:
        """Async scheduling: step N+1 is planned and launched while step N runs, then N's results are folded back;
        the caller processes them (detokenizing, stop strings) while N+1 runs. With spec decode the next plan needs
        N's drafts, so it is made right after N's results instead."""
        flight = self.steps_in_flight
        if not flight and not self._submit_next():
            return []
        if not self.spec_config and not self._constrained_running():
            self._submit_next()  # placeholders stand in for the tokens step N is sampling
        sched_out, handle = flight.popleft()
        runner_out = self.executor.collect_execute(handle)  # (N+1 runs meanwhile, fed N's tokens on the device)
        self._observe_timings(sched_out, runner_out)
        outputs = self.scheduler.update_from_output(sched_out, runner_out)
        if not flight:
            self._submit_next()
        self._flush_if_idle()
        return outputs

    def _submit_next(self) -> bool:
        """Plan a step and start it (`Executor.submit_execute`); False when there is nothing to run."""
        sched_out = self._schedule()
        if sched_out.is_empty and not sched_out.finished_req_ids and sched_out.kv_connector_metadata is None:
            return False
        self.steps_in_flight.append((sched_out, self.executor.submit_execute(sched_out)))
        self.num_steps += 1
        return True

    def _constrained_running(self) -> bool:
        """Whether a running request follows a grammar or tracks its reasoning: its next bitmask needs the tokens
        of the step in flight, so the next step is planned after them (as with spec decode)."""
        if self._structured_output_manager is None and self.reasoning_tokens is None:
            return False
        return any(r.structured_output is not None or r.reasoning is not None for r in self.scheduler.running)

    def _observe_timings(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        """Resize the per-step encoder budget from the step's measured timings (a user-set budget stays)."""
        if sched_out.is_empty or self.encoder_budget.fixed is not None:
            return
        num_drafts = sum(len(t) for t in sched_out.scheduled_spec_decode_tokens.values())
        is_decode = bool(sched_out.num_scheduled_tokens) and (  # (a step of encoder slices only is none)
            sched_out.total_num_scheduled_tokens == len(sched_out.num_scheduled_tokens) + num_drafts
        )
        budget = self.encoder_budget.observe(
            runner_out.encoder_seconds, runner_out.num_encoded_embeds, runner_out.step_seconds, is_decode
        )
        self.scheduler.set_encoder_budget(budget, self.encoder_budget.slice_cap, self.encoder_budget.pack)

    def _drain_in_flight(self) -> None:
        """Wait for queued steps and fold back what they sampled (their requests may have finished meanwhile)."""
        while self.steps_in_flight:
            sched_out, handle = self.steps_in_flight.popleft()
            self.scheduler.update_from_output(sched_out, self.executor.collect_execute(handle))

    def _flush_if_idle(self) -> None:
        """When nothing is left to run, let the runner drop finished requests now rather than next step."""
        if self.scheduler.has_unfinished_requests():
            return
        if self.steps_in_flight:
            self._drain_in_flight()
        if self.batch_queue is not None:
            self.batch_queue.drain()
        if self.scheduler.finished_req_ids:
            self.executor.execute_model(self.scheduler.schedule())

    def shutdown(self) -> None:
        """Finish the steps in flight (async scheduling), stop the grammar compilers and the ranks."""
        if self._structured_output_manager is not None:
            self._structured_output_manager.shutdown()
        if self.steps_in_flight is not None:
            try:
                self._drain_in_flight()
            finally:
                self.steps_in_flight.clear()
        if self.batch_queue is not None:
            self.batch_queue.discard()
        self.executor.shutdown()

    # -- metrics -----------------------------------------------------------------------------------------------
    def get_metrics(self) -> dict[str, float]:
        """Counters and gauges under the names they carry on /metrics."""
        s = self.scheduler
        st, enc, ranks, connector = s.stats, s.encoder_cache, self.executor.stats(), s.kv_transfer.connector
        per_modality = {}  # `name{modality="..."}`: /metrics exports these as one labelled family per name
        for name, counts in (
            ("encoder_runs_by_modality_total", ranks.encoder_runs_by_modality),
            ("encoder_cache_hits_by_modality_total", enc.hits_by_modality),
            ("encoder_cache_misses_by_modality_total", enc.misses_by_modality),
        ):
            for modality in self.loaded.modalities:
                per_modality[f'vlserve:{name}{{modality="{modality}"}}'] = counts.get(modality, 0)
        return {
            **per_modality,
            "vlserve:num_requests_running": len(s.running),
            "vlserve:num_requests_waiting": len(s.waiting),
            "vlserve:kv_cache_usage": s.kv.usage,
            "vlserve:num_kv_blocks": self.executor.num_blocks,  # 0 on an encode server
            "vlserve:prefix_cache_queries_total": s.kv.prefix_queries,
            "vlserve:prefix_cache_hits_total": s.kv.prefix_hits,
            "vlserve:num_preemptions_total": st.num_preemptions,
            "vlserve:prompt_tokens_total": st.prompt_tokens,
            "vlserve:generation_tokens_total": st.generation_tokens,
            "vlserve:encoder_cache_hits_total": enc.hits,
            "vlserve:encoder_cache_misses_total": enc.misses,
            "vlserve:encoder_cache_evictions_total": enc.evictions,
            "vlserve:encoder_cache_usage": enc.usage,
            "vlserve:encoder_runs_total": ranks.num_encoder_runs,
            "vlserve:cuda_graph_replays_total": ranks.num_graph_replays,
            "vlserve:eager_forwards_total": ranks.num_eager_forwards,
            "vlserve:spec_decode_num_drafts_total": st.spec_num_drafts,
            "vlserve:spec_decode_num_draft_tokens_total": st.spec_num_draft_tokens,
            "vlserve:spec_decode_num_accepted_tokens_total": st.spec_num_accepted_tokens,
            **({} if self.batch_queue is None else {"vlserve:max_batches_in_flight": self.batch_queue.max_in_flight}),
            **{f"vlserve:{k}": v for k, v in s.kv_pool_gauges().items()},
            **({} if connector is None else {f"vlserve:{k}": v for k, v in connector.stats().items()}),
            **{f"vlserve:{k}": v for k, v in ranks.ec_counters.items()},
        }

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        if not self.has_unfinished_requests():
            stats = self.executor.stats()
            assert not stats.num_requests, f"the runner still tracks {stats.num_requests} requests"
            assert not stats.num_partial_encodes, f"the runner still holds {stats.num_partial_encodes} partial encodes"

    @staticmethod
    def now() -> float:
        return time.time()

    def device_synchronize(self) -> None:
        if self.executor.device.type == "cuda":
            torch.cuda.synchronize()
