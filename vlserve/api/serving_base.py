"""Pieces shared by the chat and completion endpoints: served models, SSE framing, streamed-text deltas,
usage, and tying a request's life to its HTTP connection (a disconnect aborts it)."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from vlserve.api.errors import APIError
from vlserve.api.protocol import ModelCard, ModelList, PromptTokensDetails, UsageInfo
from vlserve.outputs import RequestOutput

_MM_KWARG_KEYS = {"min_pixels", "max_pixels", "fps", "num_frames", "max_frames"}


@dataclass
class ServedModels:
    """The model names this server answers to (the first is reported in responses)."""

    names: list[str]
    root: str
    max_model_len: int

    def check(self, model: str | None) -> str:
        """The name to report; 404 when a name was given that we do not serve."""
        if model in (None, ""):
            return self.names[0]
        if model not in self.names:
            raise APIError(f"The model `{model}` does not exist. Served: {', '.join(self.names)}", 404, "model")
        return model

    def list(self) -> ModelList:
        return ModelList(data=[ModelCard(id=n, root=self.root, max_model_len=self.max_model_len)
                               for n in self.names])


def check_mm_processor_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """Only the documented per-request media knobs, with positive numeric values (400 otherwise)."""
    if not kwargs:
        return None
    for key, value in kwargs.items():
        if key not in _MM_KWARG_KEYS:
            raise APIError(f"unsupported mm_processor_kwargs key {key!r}; use {sorted(_MM_KWARG_KEYS)}", 400,
                           "mm_processor_kwargs")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise APIError(f"mm_processor_kwargs[{key!r}] must be a positive number, got {value!r}", 400,
                           "mm_processor_kwargs")
    return dict(kwargs)


def sse(payload: Any) -> str:
    """One server-sent event (`data: <json>`)."""
    text = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {text}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage_of(outputs: list[RequestOutput]) -> UsageInfo:
    """Token usage summed over the RequestOutputs of one API request."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


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
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, **kwargs)

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
