"""Pieces shared by the chat and completion endpoints: served models, SSE framing, streamed-text deltas,
usage, and tying a request's life to its HTTP connection (a disconnect aborts it)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from vlserve.api.errors import APIError
from vlserve.api.protocol import CompletionTokensDetails, ModelCard, ModelList, PromptTokensDetails, UsageInfo
from vlserve.engine.request_limits import check_max_tokens_fit
from vlserve.multimodal.video_pruning import PRUNING_KEY, check_video_pruning_rate
from vlserve.outputs import RequestOutput
from vlserve.shorten import shorten

_MM_KWARG_KEYS = {"min_pixels", "max_pixels", "fps", "num_frames", "max_frames"}


@dataclass
class ServedModels:
    """The model names this server answers to (the first is reported in responses), and the LoRA adapters served
    as models of their own (`loras`: name -> its LoRARequest; see api/lora_adapters.py)."""

    names: list[str]
    root: str
    max_model_len: int
    loras: dict[str, Any] = field(default_factory=dict)
    tasks: list[str] | None = None  # on every card: ["generate"] or the pooling tasks (api/serving_pooling.py)
    _last_lora_id: int = 0

    def check(self, model: str | None) -> str:
        """The name to report; 404 when a name was given that we do not serve."""
        if model in (None, ""):
            return self.names[0]
        if model not in self.names and model not in self.loras:
            served = ", ".join(self.names + list(self.loras))
            raise APIError(f"model {shorten(model)} does not exist; this server serves: {served}", 404, "model")
        return model

    def lora_of(self, model: str) -> Any:
        """The LoRARequest a (checked) model name runs with; None for the base model."""
        return self.loras.get(model)

    def next_lora_id(self) -> int:
        """A fresh adapter id (increasing, never reused: prefix-cache blocks are keyed by it)."""
        self._last_lora_id += 1
        return self._last_lora_id

    def list(self) -> ModelList:
        cards = [
            ModelCard(id=n, root=self.root, max_model_len=self.max_model_len, tasks=self.tasks) for n in self.names
        ]
        cards += [
            ModelCard(
                id=name, root=lora.lora_path, parent=self.names[0], max_model_len=self.max_model_len, tasks=self.tasks
            )
            for name, lora in self.loras.items()
        ]
        return ModelList(data=cards)


@dataclass
class MMKwargLimits:
    """Upper bounds on per-request mm_processor_kwargs (from the checkpoint's processor and the server's defaults)."""

    max_pixels: int | None = None  # for min_pixels and max_pixels
    max_frames: int | None = None  # for num_frames and max_frames

    @classmethod
    def from_engine(cls, engine: Any) -> MMKwargLimits:
        """The processor's configured pixel budget (or the server's --mm-processor-kwargs, when larger) and frame cap."""
        proc = getattr(engine.input_processor, "mm_processor", None)
        if proc is None:
            return cls()
        size = getattr(proc.image_processor, "size", None) or {}
        pixels = size.get("longest_edge") or getattr(proc.image_processor, "max_pixels", None)
        server_pixels = (engine.engine_args.mm_processor_kwargs or {}).get("max_pixels")
        if pixels is not None and isinstance(server_pixels, int):
            pixels = max(pixels, server_pixels)
        return cls(max_pixels=None if pixels is None else int(pixels), max_frames=int(proc.max_video_frames))


def with_pruning_rate(mm_kwargs: dict[str, Any] | None, rate: Any) -> dict[str, Any] | None:
    """The request's processor kwargs with its `video_pruning_rate` (over the server's; None: the server's), or a
    400 naming the field when it is not in [0, 1)."""
    if rate is None:
        return mm_kwargs
    try:
        rate = check_video_pruning_rate(rate)
    except ValueError as e:
        raise APIError(str(e), 400, "video_pruning_rate") from None
    return {**(mm_kwargs or {}), PRUNING_KEY: rate}


def check_mm_processor_kwargs(
    kwargs: dict[str, Any] | None, limits: MMKwargLimits | None = None
) -> dict[str, Any] | None:
    """Only the documented per-request media knobs, with positive values within the server's bounds (400 otherwise)."""
    if not kwargs:
        return None
    limits = limits or MMKwargLimits()
    unknown = [k for k in kwargs if k not in _MM_KWARG_KEYS]
    if unknown:
        names = ", ".join(shorten(k) for k in unknown[:5])
        raise APIError(
            f"mm_processor_kwargs: unsupported key(s) {names}; allowed: {', '.join(sorted(_MM_KWARG_KEYS))}",
            400,
            "mm_processor_kwargs",
        )
    for key, value in kwargs.items():
        whole = key != "fps"
        ok_type = (int,) if whole else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok_type) or value <= 0:
            kind = "a positive integer" if whole else "a positive number"
            raise APIError(
                f"mm_processor_kwargs.{key} must be {kind}, got {shorten(value)}", 400, "mm_processor_kwargs"
            )
        bound = limits.max_pixels if key.endswith("_pixels") else limits.max_frames if whole else None
        if bound is not None and value > bound:
            raise APIError(
                f"mm_processor_kwargs.{key} may be at most {bound} on this server, got {value}",
                400,
                "mm_processor_kwargs",
            )
    lo, hi = kwargs.get("min_pixels"), kwargs.get("max_pixels")
    if lo is not None and hi is not None and lo > hi:
        raise APIError(
            f"mm_processor_kwargs.min_pixels ({lo}) must be <= max_pixels ({hi})", 400, "mm_processor_kwargs"
        )
    return dict(kwargs)


def check_fits_context(
    max_tokens: int | None, prompt_tokens: int, max_model_len: int, field: str = "max_tokens"
) -> None:
    """400 (param `field`, the name the client used) when the prompt plus the requested completion exceed the
    model's context."""
    try:
        check_max_tokens_fit(max_tokens, prompt_tokens, max_model_len, field)
    except ValueError as e:
        raise APIError(str(e), 400, field) from None


def check_kv_transfer_params(engine: Any, req: Any, num_prompts: int = 1) -> None:
    """A request's kv_transfer_params need a server with a KV connector (no silent ignore) and one sequence: one
    prompt, n=1, no beam search (APIError naming the field)."""
    if req.kv_transfer_params is None:
        return
    if getattr(engine.engine_args, "kv_transfer_config", None) is None:
        raise APIError(
            "kv_transfer_params needs a server started with a KV connector (--kv-transfer-config); this one has none",
            400,
            "kv_transfer_params",
        )
    if num_prompts != 1 or req.n != 1 or getattr(req, "use_beam_search", False):
        raise APIError(
            "kv_transfer_params applies to one sequence: send one prompt with n=1 and no beam search",
            400,
            "kv_transfer_params",
        )


def structured_backend(engine: Any) -> str:
    """The grammar backend the engine compiles output constraints with (what guided_decoding_backend may name)."""
    config = getattr(engine.engine_args, "structured_outputs_config", None)
    return getattr(config, "backend", None) or "xgrammar"


def sse(payload: Any) -> str:
    """One server-sent event (`data: <json>`)."""
    text = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {text}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage_of(outputs: list[RequestOutput], reasoning_parser=None) -> UsageInfo:
    """Token usage summed over the RequestOutputs of one API request; with a reasoning parser, also how many
    output tokens lie inside the reasoning."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    details = None
    if reasoning_parser is not None:
        reasoning = sum(
            reasoning_parser.num_reasoning_tokens(c.token_ids, o.prompt_token_ids) for o in outputs for c in o.outputs
        )
        details = CompletionTokensDetails(reasoning_tokens=reasoning)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        completion_tokens_details=details,
    )


class DeltaTracker:
    """Turns cumulative outputs into stream deltas; holds back a possible stop-string prefix until it is decided."""

    def __init__(self, holdback: int):
        self.holdback = holdback
        self.sent_text: dict[int, int] = {}
        self.sent_logprobs: dict[int, int] = {}
        self.done: set[int] = set()

    def delta(self, index: int, text: str, logprobs: list | None, finished: bool) -> tuple[str, list | None]:
        """(new text, new logprob entries) of sequence `index` since the last call."""
        start = self.sent_text.get(index, 0)
        end = len(text) if finished else max(start, len(text) - self.holdback)
        self.sent_text[index] = end
        new_lp = None
        if logprobs is not None:
            lp_start = self.sent_logprobs.get(index, 0)
            new_lp = logprobs[lp_start:]
            self.sent_logprobs[index] = len(logprobs)
        if finished:
            self.done.add(index)
        return text[start:end], new_lp


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(raw: Request, work: Awaitable[Any], on_disconnect: Callable[[], None]) -> Any:
    """Await `work`; if the client disconnects first, cancel it, call `on_disconnect` and raise APIError(499)
    (nobody reads that response; it just ends the handler quietly)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        on_disconnect()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    on_disconnect()
    raise APIError("client closed the connection", 499)


class EngineStreamingResponse(StreamingResponse):
    """SSE response that always closes its generator (so the request is aborted) and notices disconnects even while
    no tokens are flowing (e.g. the request is still queued)."""

    def __init__(self, content: AsyncIterator[str], **kwargs: Any):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            **kwargs,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream_task = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (stream_task, watcher):
                if not t.done():
                    t.cancel()
            await asyncio.gather(stream_task, watcher, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
