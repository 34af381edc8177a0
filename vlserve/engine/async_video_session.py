"""Live video sessions over the asyncio engine (`AsyncLLM`, `MPAsyncLLM`): what the server's video routes drive.

`AsyncSessionEngine` is the `SessionEngine` of a session on an event loop: a prefill is queued and drained by a
task on the loop (cancelled and aborted when a grown prefix supersedes it), and encoder-cache eviction is a control
call (`evict_encoder_items`) that runs on the engine's own thread or process; both may be called from any thread.
`AsyncVideoSession` runs the HF processor's work (`VideoSession.append`, `ask_prompt`) in the engine's
preprocessing pool, one call at a time per session, and streams a question's answer as an ordinary request: appends
never wait for answers, and an answer sees the frames present when its question arrived. `AsyncVideoSessions`
holds the open sessions (count and idle bounds from `VideoSessions`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from vlserve.engine.input_processor import ProcessedPrompt
from vlserve.engine.video_session import VideoSession, VideoSessions
from vlserve.outputs import RequestOutput
from vlserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_PREFILL_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


class AsyncSessionEngine:
    """`SessionEngine` over an async engine whose requests run on `loop`; every method may be called from any
    thread (`generate` from any thread but the loop's)."""

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop):
        self.llm = llm
        self.loop = loop
        self.prefills: dict[str, concurrent.futures.Future] = {}  # request id -> its drain task
        self.evictions: set[concurrent.futures.Future] = set()  # control calls not yet answered

    def prefill(self, request_id: str, processed: ProcessedPrompt) -> bool:
        """Queue the prefill and drain it on the loop; returns False at once."""
        future = asyncio.run_coroutine_threadsafe(self._drain(request_id, processed), self.loop)
        self.prefills[request_id] = future
        future.add_done_callback(lambda _: self.prefills.pop(request_id, None))
        return False

    async def _drain(self, request_id: str, processed: ProcessedPrompt) -> None:
        try:
            stream = await self.llm.add_request(request_id, processed, _PREFILL_PARAMS)
            async with stream:
                async for _ in stream:
                    pass
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the prefill only warms the caches: a question computes what it missed
            logger.warning("video session prefill %s failed: %s", request_id, e)

    def running_prefill(self, request_id: str | None) -> concurrent.futures.Future | None:
        """The drain of prefill `request_id` while it runs."""
        return self.prefills.get(request_id) if request_id is not None else None

    def generate(self, request_id: str, processed: ProcessedPrompt, params: SamplingParams) -> RequestOutput:
        async def run() -> RequestOutput:
            outputs = []
            async with await self.llm.add_request(request_id, processed, params) as stream:
                async for out in stream:
                    outputs[:] = [out]
            return outputs[0]

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result()

    def abort(self, request_id: str) -> None:
        future = self.prefills.get(request_id)
        if future is not None:
            future.cancel()  # a drain not yet accepted by the engine aborts its request once it is
        self.llm.abort(request_id)

    def forget_items(self, mm_hashes: list[str]) -> None:
        future = asyncio.run_coroutine_threadsafe(self.llm.evict_encoder_items(list(mm_hashes)), self.loop)
        self.evictions.add(future)
        future.add_done_callback(self.evictions.discard)

    async def flush(self) -> None:
        """Wait (on the loop) until every eviction asked for so far has run in the engine."""
        pending = [asyncio.wrap_future(f) for f in list(self.evictions)]
        if pending:
            await asyncio.wait(pending)


@dataclass
class PreparedQuestion:
    """A question's prompt and the frames in it."""

    processed: ProcessedPrompt
    num_frames: int


class AsyncVideoSession:
    """A `VideoSession` driven from an event loop: `append`, `ask` (an async iterator of cumulative outputs),
    `close`; `closed` is set once the session ended, `close_reason` says why ("closed", "deleted", "expired")."""

    def __init__(self, session: VideoSession, engine: AsyncSessionEngine, model: str, created: int):
        self.session = session
        self.engine = engine
        self.llm = engine.llm
        self.model = model
        self.created = created
        self.lock = asyncio.Lock()  # one pool call (append / prompt) at a time, in arrival order
        self.closed = asyncio.Event()
        self.close_reason = ""
        self.questions: set[str] = set()  # running question request ids
        self._ids = itertools.count()

    @property
    def session_id(self) -> str:
        return self.session.session_id

    async def append(self, frames: Any) -> None:
        """Add frames (HxWx3 uint8 arrays or PIL images) and queue the grown prefix's prefill (ValueError for bad
        frames; the session is left as it was)."""
        async with self.lock:
            await self.llm._in_pool(self.session.append, frames)

    async def prepare_question(self, question: str) -> PreparedQuestion:
        """A question's prompt over the frames appended so far, built in turn with the appends (ValueError: no
        frames yet, the session closed, ...)."""
        async with self.lock:
            processed, num_frames = await self.llm._in_pool(self._question_prompt, question)
        return PreparedQuestion(processed, num_frames)

    async def answer(self, prepared: PreparedQuestion, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Stream a prepared question's cumulative outputs until the answer ends (leaving early aborts it)."""
        prefill = self.engine.running_prefill(self.session.prefills.request_id)
        if prefill is not None:  # the prefix being computed: the question then finds it in the prefix cache
            await asyncio.wait([asyncio.wrap_future(prefill)])
        request_id = f"{self.session_id}-ask-{next(self._ids)}"
        self.questions.add(request_id)
        try:
            async with await self.llm.add_request(request_id, prepared.processed, params) as stream:
                async for out in stream:
                    yield out
        finally:
            self.questions.discard(request_id)
            self._forget_outside_window(prepared.processed)

    def _question_prompt(self, question: str) -> tuple[ProcessedPrompt, int]:
        session = self.session
        if not session.closed and session.expired():
            session.close()
        if session.closed:
            raise ValueError(f"video session {self.session_id} is closed (or expired after idling)")
        session.last_used = session.clock()
        return session.ask_prompt(question), session.stream.num_frames

    def _forget_outside_window(self, processed: ProcessedPrompt) -> None:
        """After an answer: evict its items that the window no longer holds (the padded odd frame, pairs dropped
        while it ran), now that no request of this session references them."""
        window = {c.mm_hash for c in list(self.session.stream.chunks)}
        gone = [f.mm_hash for f in processed.mm_features if f.mm_hash not in window]
        if gone:
            self.engine.forget_items(gone)

    async def close(self, reason: str = "closed") -> None:
        """End the session: its answers and prefill are aborted, its encoder entries evicted (done when this
        returns). Idempotent."""
        self.close_reason = self.close_reason or reason
        for request_id in list(self.questions):
            self.llm.abort(request_id)
        if not self.session.closed:
            await self.llm._in_pool(self.session.close)
        await self.engine.flush()
        self.closed.set()

    def describe(self) -> dict[str, Any]:
        """The session as the REST routes show it."""
        stream = self.session.stream
        return {
            "id": self.session_id,
            "object": "video.session",
            "created": self.created,
            "model": self.model,
            "fps": stream.fps,
            "max_frames": stream.max_frames,
            "frames": stream.frames_seen,
            "window_frames": stream.num_frames,
            "idle_timeout": self.session.idle_timeout,
        }


class AsyncVideoSessions:
    """The open sessions of an async engine: at most `max_sessions`, one idle for `idle_timeout` seconds closed by
    `sweep` (which the server runs now and then) or on its next use."""

    def __init__(self, llm: Any, max_sessions: int, idle_timeout: float):
        self.llm = llm
        self.bounds = VideoSessions(max_sessions, idle_timeout)
        self.open: dict[str, AsyncVideoSession] = {}

    @property
    def max_sessions(self) -> int:
        return self.bounds.max_sessions

    async def create(self, model: str, created: int, **kwargs: Any) -> AsyncVideoSession:
        """Open a session (kwargs: VideoSession's); ValueError for bad arguments or when `max_sessions` are open
        (`is_full` tells which, before)."""
        await self.sweep()
        engine = AsyncSessionEngine(self.llm, asyncio.get_running_loop())
        # on the loop (a chat template rendered, no media): the count check and the registration stay one step
        session = self.bounds.create(engine, self.llm.input_processor, self.llm.max_model_len, **kwargs)
        wrapped = AsyncVideoSession(session, engine, model, created)
        self.open[session.session_id] = wrapped
        return wrapped

    async def is_full(self) -> bool:
        """Whether a new session would pass `max_sessions` (idle ones are closed first)."""
        await self.sweep()
        return len(self.open) >= self.max_sessions

    async def get(self, session_id: str) -> AsyncVideoSession | None:
        """The open session `session_id` (None: unknown, closed or expired)."""
        await self.sweep()
        return self.open.get(session_id)

    async def close(self, session_id: str, reason: str = "closed") -> bool:
        """Close a session (False when it is not open)."""
        session = self.open.pop(session_id, None)
        if session is None:
            return False
        await session.close(reason)
        return True

    async def sweep(self) -> list[str]:
        """Close the sessions idle past the timeout (and forget closed ones); returns their ids."""
        ended = [s for s in self.open.values() if s.session.closed or s.session.expired()]
        for s in ended:
            self.open.pop(s.session_id, None)
        for s in ended:
            await s.close("expired")
        return [s.session_id for s in ended]
