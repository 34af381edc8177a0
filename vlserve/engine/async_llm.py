"""`AsyncLLM`: the asyncio front end of the engine (what the OpenAI server drives).

The engine core steps in one dedicated background thread, so the event loop never waits on model compute.
Requests and aborts cross into that thread through a thread-safe queue; each step's outputs go back to
per-request asyncio queues through `loop.call_soon_threadsafe`. Input processing (tokenizer, chat template, media
decoding and resizing, HF processor) runs in a pool of `mm_preprocess_workers` threads (`--mm-preprocess-workers`),
also off the event loop, so one slow request (a big image, a long prompt) does not hold up the others; the
multimodal processor and its item cache are shared by the pool's threads (thread-safe).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from vlserve.config import EngineArgs
from vlserve.engine.core_messages import KV_POLL_S
from vlserve.engine.engine_control import Control, ControlCalls, EngineDeadError, _post, _settle, settle_control
from vlserve.engine.engine_loop import EngineLoop, NewRequest
from vlserve.engine.input_processor import ChatTemplateOptions, ProcessedPrompt
from vlserve.executor import WorkerDied
from vlserve.outputs import PoolingRequestOutput, RequestOutput
from vlserve.pooling_params import PoolingParams
from vlserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class StatsListener(Protocol):
    """Receives per-request latency events from the engine thread (must be thread-safe and fast)."""

    def on_first_token(self, seconds: float) -> None: ...

    def on_inter_token(self, seconds: float) -> None: ...

    def on_finished(self, finish_reason: str, e2e_seconds: float, prompt_tokens: int, output_tokens: int) -> None: ...


@dataclass
class _Stream:
    """Where one request's outputs go: an asyncio queue on the caller's loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    num_tokens: int = 0
    last_token_time: float | None = None


@dataclass
class _Add:
    request_id: str
    processed: ProcessedPrompt
    params: SamplingParams | PoolingParams
    arrival: float
    stream: _Stream
    done: asyncio.Future = field(repr=False)
    lora_request: Any = None  # a vlserve.lora.LoRARequest, or None (the base model)
    priority: int = 0


@dataclass
class _Abort:
    request_id: str


_STOP = object()


class AsyncLLM(ControlCalls):
    """Async engine client: `generate()` yields cumulative `RequestOutput`s while a background thread steps the core.

    Build with `AsyncLLM.from_engine_args(EngineArgs(...))`; call `shutdown()` when done.
    """

    def __init__(
        self, engine_args: EngineArgs, input_workers: int | None = None, engine_loop: EngineLoop | None = None
    ):
        self.engine_args = engine_args
        if engine_loop is None and engine_args.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size > 1 (got {engine_args.data_parallel_size}) needs the engine in "
                "its own processes (MPAsyncLLM, `vlserve serve` without --no-engine-process)"
            )
        # touched only by the engine thread, input_processor aside; `engine_loop` lets a subclass drive another
        self.engine_loop = engine_loop if engine_loop is not None else EngineLoop(engine_args)
        self.engine = self.engine_loop.core
        self.tokenizer = self.engine_loop.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.modalities = tuple(self.engine.loaded.modalities)
        self.input_processor = self.engine_loop.input_processor
        # Several workers: a slow input does not block the rest. The fast tokenizer is only read (no truncation or
        # padding state changes), which is safe from several threads; the multimodal processor locks its cache.
        self.num_input_workers = input_workers or engine_args.mm_preprocess_workers
        self._executor = ThreadPoolExecutor(max_workers=self.num_input_workers, thread_name_prefix="vlserve-preprocess")
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}  # touched only by the engine thread
        self._ids = itertools.count()
        self._listeners: list[StatsListener] = []
        self._metrics: dict[str, float] = self.engine.get_metrics()
        self.num_aborted = 0
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run_engine_thread, name="vlserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        """Load the checkpoint and start the engine thread."""
        return cls(args, **kwargs)

    # -- input processing (thread pool) ----------------------------------------------------------------------
    async def _in_pool(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def process_prompt(
        self,
        prompt: Any,
        images: list | None = None,
        videos: list | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> ProcessedPrompt:
        """Tokenize a prompt (string, token ids or vLLM-style dict) and process its media, off the event loop."""
        return await self._in_pool(self.input_processor.process_prompt, prompt, images, videos, mm_processor_kwargs)

    async def process_chat(
        self,
        messages: list[dict],
        mm_processor_kwargs: dict | None = None,
        chat_template_kwargs: dict | None = None,
        media_source: Callable[[str, dict], Any] | None = None,
        options: ChatTemplateOptions | None = None,
    ) -> ProcessedPrompt:
        """OpenAI messages through the chat template and the HF processor, off the event loop.

        `media_source(part_type, part)` supplies each media part's payload (the server hands over pre-fetched bytes);
        `options`: generation prompt / continued final message / special tokens (ChatTemplateOptions).
        """
        process = functools.partial(self.input_processor.process_chat, media_source=media_source, options=options)
        return await self._in_pool(process, messages, mm_processor_kwargs, chat_template_kwargs)

    # -- requests --------------------------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str | None,
        prompt: ProcessedPrompt,
        sampling_params: SamplingParams | None = None,
        lora_request=None,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a processed prompt; returns once the engine accepted it (ValueError / QueueFullError if not).
        `priority`: its place under scheduling policy "priority" (lower first; fcfs refuses a non-zero one)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running ({self._dead})")
        params = sampling_params or SamplingParams()
        # a grammar that does not compile is the client's 400, now
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            await self._in_pool(self.input_processor.check_structured_outputs, params.structured_outputs)
        rid = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), time.time())
        done = loop.create_future()
        self._inbox.put(_Add(rid, prompt, params, stream.arrival, stream, done, lora_request, priority))
        if self._dead is not None:  # the engine died between the check above and the put: nobody will read it
            self._fail_all(EngineDeadError(f"the engine is not running ({self._dead})"), drain_inbox=True)
        try:
            await done  # raises what add_request raised in the engine thread
        except asyncio.CancelledError:
            self.abort(rid)  # queued behind the add, so it cannot be missed
            raise
        return RequestStream(self, rid, stream.queue)

    async def add_pooling_request(
        self,
        request_id: str | None,
        prompt: ProcessedPrompt,
        pooling_params: PoolingParams,
        lora_request=None,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a processed prompt on a pooling engine; returns once the engine accepted it (ValueError if not:
        bad params, or an engine that generates). Its stream's one output is a PoolingRequestOutput."""
        if not isinstance(pooling_params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}")
        return await self.add_request(request_id, prompt, pooling_params, lora_request, priority)

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        images: list | None = None,
        videos: list | None = None,
        mm_processor_kwargs: dict | None = None,
        lora_request=None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs until the request finishes (the last one has `finished=True`).

        `prompt` is a string, token ids, a vLLM-style dict or an already `ProcessedPrompt`. Closing or cancelling
        the iterator aborts the request and frees its KV blocks and encoder cache references.
        """
        if not isinstance(prompt, ProcessedPrompt):
            prompt = await self.process_prompt(prompt, images, videos, mm_processor_kwargs)
        stream = await self.add_request(request_id, prompt, sampling_params, lora_request, priority)
        async with stream:
            async for out in stream:
                yield out

    async def chat(
        self,
        messages: list[dict],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        mm_processor_kwargs: dict | None = None,
        chat_template_kwargs: dict | None = None,
        lora_request=None,
    ) -> AsyncIterator[RequestOutput]:
        """Like `generate`, for OpenAI-format messages."""
        processed = await self.process_chat(messages, mm_processor_kwargs, chat_template_kwargs)
        async for out in self.generate(processed, sampling_params, request_id, lora_request=lora_request):
            yield out

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; unknown or finished ids are ignored)."""
        self._inbox.put(_Abort(request_id))

    # -- introspection ---------------------------------------------------------------------------------------
    def add_stats_listener(self, listener: StatsListener) -> None:
        """Get TTFT / inter-token / finish events (called from the engine thread)."""
        self._listeners.append(listener)

    def get_metrics(self) -> dict[str, float]:
        """The core's `vlserve:` counters and gauges, as of the engine thread's last iteration, and the input
        processor's (the multimodal processor cache: this process preprocesses)."""
        return {**self._metrics, **self.input_processor.get_metrics()}

    @property
    def runner_type(self) -> str:
        """ "pooling" when the engine pools prompts (embed / classify / score / encode), else "generate"."""
        return self.engine.runner_type

    @property
    def pooling_tasks(self) -> set[str]:
        """The PoolingParams tasks the engine serves (none when it generates)."""
        return self.engine.pooling_tasks

    @property
    def model_capabilities(self):
        """The served model's `ModelCapabilities` (e.g. `dual_tower`: each request is one text or one image)."""
        return self.engine.model_capabilities

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (open requests end with finish_reason "abort") and the input pool."""
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join(timeout)
        self._executor.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():
            self.engine.shutdown()  # the executor's ranks, the runner thread

    # -- the engine thread -----------------------------------------------------------------------------------
    def _run_engine_thread(self) -> None:
        try:
            while True:
                busy = self.engine_loop.has_unfinished_requests()
                polling = not busy and self.engine_loop.has_kept_kv_blocks()  # idle, but kept blocks to free
                if not self._drain_inbox(not busy, KV_POLL_S if polling else None):
                    break
                if self.engine_loop.has_unfinished_requests() or self.engine_loop.has_kept_kv_blocks():
                    try:
                        self._step()
                    except WorkerDied:
                        raise  # a rank is gone: the engine is dead (below), not just this step
                    except Exception as e:
                        logger.exception("engine step failed; aborting the requests in flight")
                        self._recover(e)
                self._metrics = self.engine.get_metrics()
        except BaseException as e:  # a bug in the core: fail every open request rather than hang them
            logger.exception("engine thread died")
            self._dead = e
            self._fail_all(EngineDeadError(f"the engine stopped: {e!r}"))
            return
        self._close_open_streams()

    def _close_open_streams(self) -> None:
        """After a clean stop: abort the requests still open and refuse new ones."""
        self._dead = EngineDeadError("shut down")
        for rid in list(self._streams):
            self._do_abort(rid)
        self._fail_all(EngineDeadError("the engine was shut down"))

    def _drain_inbox(self, block: bool, timeout: float | None = None) -> bool:
        """Apply queued adds/aborts (waiting at most `timeout` for the first when blocking); False when asked to
        stop."""
        while True:
            try:
                msg = self._inbox.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return True
            block = False
            if msg is _STOP:
                return False
            if isinstance(msg, _Abort):
                self._do_abort(msg.request_id)
            elif isinstance(msg, Control):
                self._do_control(msg)
            else:
                self._do_add(msg)

    def _start_stream(self, msg: _Add) -> bool:
        """Hand the request to the engine loop and register its stream; False (and the caller told why) when the
        engine refuses it."""
        request = NewRequest(msg.request_id, msg.processed, msg.params, msg.arrival, msg.lora_request, msg.priority)
        try:
            if isinstance(msg.params, PoolingParams):
                self.engine_loop.add_pooling_requests([request])
            else:
                self.engine_loop.add_requests([request])
        except Exception as e:
            _post(msg.stream.loop, _settle, msg.done, e)
            return False
        self._streams[msg.request_id] = msg.stream
        return True

    def _do_add(self, msg: _Add) -> None:
        if not self._start_stream(msg):
            return
        if not _post(msg.stream.loop, _settle, msg.done, None):
            self._do_abort(msg.request_id)

    def _do_abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        final = self.engine_loop.abort(request_id)
        self.num_aborted += 1
        if final is not None:
            self._notify_finished(stream, final)
            _post(stream.loop, stream.queue.put_nowait, final)

    def _step(self) -> None:
        outputs = self.engine_loop.step()
        now = time.time()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            self._observe(stream, out, now)
            if out.finished:
                del self._streams[out.request_id]
                self._notify_finished(stream, out)
            by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():  # one wake-up per loop per step
            if not _post(loop, _deliver, items):
                for rid in [rid for rid, st in self._streams.items() if st.loop is loop]:
                    self._do_abort(rid)

    def _observe(self, stream: _Stream, out: RequestOutput, now: float) -> None:
        if isinstance(out, PoolingRequestOutput):  # no tokens: only its end is reported
            return
        num = sum(len(o.token_ids) for o in out.outputs)
        if num <= stream.num_tokens or not self._listeners:
            stream.num_tokens = max(num, stream.num_tokens)
            return
        for listener in self._listeners:
            if stream.last_token_time is None:
                listener.on_first_token(now - stream.arrival)
            else:
                listener.on_inter_token(now - stream.last_token_time)
        stream.num_tokens, stream.last_token_time = num, now

    def _notify_finished(self, stream: _Stream, out: RequestOutput | PoolingRequestOutput) -> None:
        if isinstance(out, PoolingRequestOutput):
            reason, n_out = ("stop" if out.outputs.data.numel() else "abort"), 0
        else:
            reasons = [o.finish_reason for o in out.outputs if o.finish_reason]
            reason = "abort" if "abort" in reasons else (reasons[0] if reasons else "abort")
            n_out = sum(len(o.token_ids) for o in out.outputs)
        for listener in self._listeners:
            try:
                listener.on_finished(reason, time.time() - stream.arrival, len(out.prompt_token_ids), n_out)
            except Exception:  # a metrics bug must not take the engine down
                logger.exception("stats listener failed")

    def _recover(self, err: Exception) -> None:
        """After a failed step: end every open request with the error and clear the core."""
        self.engine_loop.abort_all()
        self._fail_all(RuntimeError(f"the engine step failed: {err!r}"), drain_inbox=False)

    def _fail_all(self, err: BaseException, drain_inbox: bool = True) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            _post(s.loop, s.queue.put_nowait, err)
        while drain_inbox:  # requests queued but never added
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, _Add):
                _post(msg.stream.loop, _settle, msg.done, err)
            elif isinstance(msg, Control):
                settle_control(msg, err)


def _deliver(items: list) -> None:
    for q, out in items:
        q.put_nowait(out)


class RequestStream:
    """Async iterator over one request's cumulative outputs; leaving `async with` early aborts the request."""

    def __init__(self, llm: AsyncLLM, request_id: str, q: asyncio.Queue):
        self.llm = llm
        self.request_id = request_id
        self._queue = q
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        # Outputs are cumulative: when the consumer lags, skip to the newest one.
        while not isinstance(item, BaseException) and not item.finished and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished."""
        if not self.finished:
            self.finished = True
            self.llm.abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.abort()
