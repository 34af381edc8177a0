"""`EngineLoop`: the one add / fan-out / abort / step path over an `EngineCore`, shared by `LLM` and `AsyncLLM`.

`LLM` calls it inline; `AsyncLLM` calls it only from its engine thread. It is not thread-safe on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from vlserve.config import EngineArgs
from vlserve.engine.core import EngineCore
from vlserve.engine.input_processor import InputProcessor, ProcessedPrompt
from vlserve.engine.output_processor import OutputProcessor, child_params, child_request_ids
from vlserve.engine.pooling import PoolingRequests
from vlserve.outputs import PoolingRequestOutput, RequestOutput
from vlserve.pooling_params import PoolingParams
from vlserve.sampling_params import SamplingParams
from vlserve.shorten import shorten


@dataclass
class NewRequest:
    """A user request to queue: its id, processed prompt, sampling params (n sequences; or, for a pooling engine,
    PoolingParams) and arrival time."""

    request_id: str
    processed: ProcessedPrompt
    params: SamplingParams | PoolingParams
    arrival: float
    lora_request: Any = None  # a vlserve.lora.LoRARequest, or None (the base model)
    priority: int = 0  # scheduling policy "priority": lower runs first


def _prepared(request: NewRequest, processed: ProcessedPrompt) -> NewRequest:
    """`request` with the prompt the engine runs (itself when preparing changed nothing)."""
    return request if processed is request.processed else replace(request, processed=processed)


class EngineLoop:
    """Front-end state around one `EngineCore`: input and output processors, n > 1 fan-out, rollback, aborts."""

    def __init__(self, args: EngineArgs, core: EngineCore | None = None):
        self.core = core if core is not None else EngineCore(args)
        loaded = self.core.loaded
        self.tokenizer = loaded.tokenizer
        self.input_processor = InputProcessor(
            loaded,
            args.limit_mm_per_prompt,
            args.processor_kwargs(),
            args.chat_template_content_format,
            args.structured_outputs_config,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        # open pooling requests: their results go around the output processor
        self.pooling = PoolingRequests(self.core.pooler_spec, loaded.hf_config.get_text_config().hidden_size)

    # -- requests ----------------------------------------------------------------------------------------------
    def add_requests(self, requests: list[NewRequest]) -> None:
        """Queue every request (each fanned out to its n sequences) or none of them.

        Raises what the core raises (ValueError, QueueFullError) or ValueError on an id already in use; a failure
        leaves neither the core nor the output processor holding any part of the batch.
        """
        seen: set[str] = set()
        for r in requests:
            if (
                r.request_id in self.output_processor.parents
                or r.request_id in seen
                or r.request_id in self.pooling.open
            ):
                raise ValueError(f"request id {shorten(r.request_id)} is already in use")
            seen.add(r.request_id)
        # a disaggregated consumer's remote media, then truncate_prompt_tokens (InputProcessor.prepare)
        requests = [_prepared(r, self.input_processor.prepare(r.processed, r.params)) for r in requests]
        engine_reqs = [
            self.input_processor.make_engine_request(
                cid, r.processed, child_params(r.params, i), r.arrival, r.lora_request, r.priority
            )
            for r in requests
            for i, cid in enumerate(child_request_ids(r.request_id, r.params.n))
        ]
        tracked: list[str] = []
        queued: list[str] = []
        try:
            for r in requests:
                self.output_processor.add_request(
                    r.request_id, r.processed.prompt, r.processed.prompt_token_ids, r.params, r.arrival
                )
                tracked.append(r.request_id)
            for req in engine_reqs:
                self.core.add_request(req)
                queued.append(req.request_id)
        except BaseException:
            self.core.abort_requests(queued)
            for rid in tracked:
                self.output_processor.abort(rid)
            raise

    def add_pooling_requests(self, requests: list[NewRequest]) -> None:
        """Queue pooling requests (their `params` are PoolingParams), all or none; ValueError when the engine
        does not pool, the params ask what it does not serve, or an id is in use."""
        engine_reqs = self.pooling.engine_requests(
            requests, self.input_processor, lambda rid: rid in self.output_processor.parents
        )
        queued: list[str] = []
        try:
            for r, req in zip(requests, engine_reqs):
                self.core.add_request(req)
                queued.append(req.request_id)
                self.pooling.track(r)
        except BaseException:
            self.core.abort_requests(queued)
            for rid in queued:
                self.pooling.open.pop(rid, None)
            raise

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a user request: its final output (open sequences end "abort"), or None when it is not open (or
        a pooling request, which is dropped)."""
        if self.pooling.open.pop(request_id, None) is not None:
            self.core.abort_requests([request_id])
            return None
        child_ids = self.output_processor.child_ids(request_id)
        final = self.output_processor.finish_aborted(request_id)
        if final is not None:
            self.core.abort_requests(child_ids)
        return final

    def abort_all(self) -> list[str]:
        """After a failure: forget every open request and clear the core; returns the user ids dropped."""
        dropped = list(self.output_processor.parents) + list(self.pooling.open)
        self.pooling.open.clear()
        for rid in dropped:
            self.output_processor.abort(rid)
        self.core.abort_requests(list(self.core.scheduler.requests))
        return dropped

    # -- the loop ----------------------------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput | PoolingRequestOutput]:
        """One core step; returns the cumulative outputs it touched, or with `final_only` those that finished
        (stop-string hits are finished in the core)."""
        core_outputs, pooled = self.pooling.split(self.core.step())
        outputs, stop_hits = self.output_processor.process_outputs(core_outputs, final_only)
        if stop_hits:
            self.core.finish_requests_stopped(stop_hits)
        return outputs + pooled if pooled else outputs

    def has_unfinished_requests(self) -> bool:
        """Whether the core still has requests to run."""
        return self.core.has_unfinished_requests()

    def has_kept_kv_blocks(self) -> bool:
        """Whether the core holds blocks for a KV transfer (poll it with `step` while idle, every `core_messages.KV_POLL_S`)."""
        return self.core.has_kept_kv_blocks()
