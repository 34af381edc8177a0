"""Live video sessions: a client appends frames as they arrive and asks questions about what it has seen so far.

A session is a request whose prompt grows; there is no second scheduler. Each append runs the new frames through the
HF video processor (`video_stream.VideoStream`) and queues a prefill-only request (one token, discarded) for the
grown prefix: the scheduler encodes the new items within its encoder budget, their embeddings enter the encoder
cache, and the prefix's full blocks enter the prefix cache. A question is one ordinary request, prefix + question,
that hits the prefix cache for every full block of the prefix, so it computes only its own tokens (plus the last,
partial block of the prefix). The prefix's blocks are not pinned: between prefills they are free, cached blocks that
heavy traffic may evict (a later prefill or question then recomputes them).

`VideoSession` talks to the engine through a `SessionEngine` (`prefill`, `generate`, `abort`, `forget_items`):
`EngineLoopSessions` runs them inline for the offline `LLM`; an async server gives its own (prefill queued and
returned at once), or submits requests itself: `extend(frames)` (the HF processor's work: off the event loop) returns
the prefix to prefill, `ask_prompt(question)` a question's prompt.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from vlserve.engine.chat import parse_chat_messages
from vlserve.engine.engine_loop import EngineLoop, NewRequest
from vlserve.engine.input_processor import ChatTemplateOptions, ProcessedPrompt
from vlserve.engine.video_stream import DEFAULT_SESSION_FPS, VideoStream
from vlserve.multimodal.video_pruning import PRUNING_KEY, check_video_pruning_rate
from vlserve.outputs import RequestOutput
from vlserve.sampling_params import SamplingParams

_PREFILL_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


class SessionEngine(Protocol):
    """What a session needs of an engine."""

    def prefill(self, request_id: str, processed: ProcessedPrompt) -> bool:
        """Compute (and cache) the KV of `processed`'s prompt; may return before it is done (False)."""

    def generate(self, request_id: str, processed: ProcessedPrompt, params: SamplingParams) -> RequestOutput:
        """Run one request to its end."""

    def abort(self, request_id: str) -> None:
        """Drop a request if it is still running."""

    def forget_items(self, mm_hashes: list[str]) -> None:
        """Evict these items' embeddings from the encoder cache where no request references them."""


class VideoSession:
    """One live stream: `append(frames)`, `ask(question, sampling_params)`, `close()`; a context manager."""

    def __init__(
        self,
        session_id: str,
        engine: SessionEngine,
        input_processor: Any,
        max_model_len: int,
        messages: list[dict] | None = None,
        fps: float = DEFAULT_SESSION_FPS,
        max_frames: int | None = None,
        max_seconds: float | None = None,
        window_slack: int = 0,
        mm_processor_kwargs: dict | None = None,
        chat_template_kwargs: dict | None = None,
        default_sampling_params: Callable[[], SamplingParams] = SamplingParams,
        idle_timeout: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.session_id = session_id
        self.engine = engine
        self.input_processor = input_processor
        self.max_model_len = max_model_len
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.default_sampling_params = default_sampling_params  # what `ask` runs with when given none
        mm = input_processor.mm_processor
        cap = mm.max_video_frames if mm is not None else 0  # the frames one video may carry
        limit = cap
        if max_frames is not None:
            if not 1 <= max_frames <= cap:
                raise ValueError(f"max_frames must be in [1, {cap}] (the frames one video may carry), got {max_frames}")
            limit = int(max_frames)
        if max_seconds is not None:
            if not isinstance(fps, (int, float)) or not max_seconds > 0 or not 0 < max_seconds * fps <= cap:
                raise ValueError(
                    f"max_seconds must be positive and max_seconds * fps at most {cap} frames (the frames one video "
                    f"may carry), got max_seconds={max_seconds} at fps={fps}"
                )
            limit = min(limit, int(max_seconds * fps))
        kwargs = {**input_processor.default_mm_kwargs, **(mm_processor_kwargs or {})}
        if check_video_pruning_rate(kwargs.pop(PRUNING_KEY, None)):
            raise ValueError(
                f"a video session's frames are not pruned; open it with mm_processor_kwargs={{'{PRUNING_KEY}': 0}}"
            )
        self.stream = VideoStream(mm, fps, limit, kwargs, window_slack, session_id)
        self.messages = self._template_messages(messages)
        self.head, _ = self._split_prompt("")
        self.clock = clock
        self.idle_timeout = idle_timeout  # seconds idle after which the session closes (None: never)
        self.last_used = clock()
        self.closed = False
        self._ids = itertools.count()
        self.prefills = _PrefillSlot(engine)  # the running prefill, aborted if the session is dropped unclosed
        self._lock = threading.Lock()

    # -- prompt rendering --------------------------------------------------------------------------------------
    @staticmethod
    def _template_messages(messages: list[dict] | None) -> list[dict]:
        if not messages:
            return []
        parsed, mm_data = parse_chat_messages(messages)
        if mm_data:
            raise ValueError("a video session's earlier messages must be text only (the stream is its video)")
        return parsed

    def _split_prompt(self, question: str) -> tuple[list[int], list[int]]:
        """The chat template around the question turn `[video, question]` -> (tokens before the video, after it)."""
        if not isinstance(question, str):
            raise ValueError(f"the question must be a string, got {type(question).__name__}")
        turn = {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}
        proc = self.input_processor
        text = proc._render_chat(self.messages + [turn], self.chat_template_kwargs, ChatTemplateOptions())
        ids = proc._tokenize(text, add_special_tokens=False)
        mm = proc.mm_processor
        pads = [i for i, t in enumerate(ids) if t == mm.video_token_id]
        if len(pads) != 1:
            raise ValueError(f"the chat template wrote {len(pads)} video placeholders for the session's one video")
        start, end = pads[0], pads[0] + 1
        if mm.qwen3_videos is not None:  # every Qwen3-VL frame run brings its own vision start / end
            start, end = mm.qwen3_videos.placeholder_span(ids, pads[0])
        return ids[:start], ids[end:]

    # -- the stream --------------------------------------------------------------------------------------------
    def append(self, frames: Any) -> None:
        """Add frames (a list of HxWx3 uint8 arrays or PIL images, oldest first) and prefill the grown prefix."""
        with self._lock:
            prefix = self._extend(frames)
            if prefix is None:
                return
            self.prefills.abort()  # superseded by the grown prefix
            request_id = f"{self.session_id}-prefill-{next(self._ids)}"
            self.prefills.request_id = None if self.engine.prefill(request_id, prefix) else request_id
            self._forget_released()

    def extend(self, frames: Any) -> ProcessedPrompt | None:
        """`append`'s first half, for a caller that submits requests itself: add the frames (the HF processor runs
        here) and return the grown prefix to prefill, or None when no pair was completed."""
        with self._lock:
            return self._extend(frames)

    def _extend(self, frames: Any) -> ProcessedPrompt | None:
        self._check_open()
        self.last_used = self.clock()
        before = self.stream.snapshot()
        try:
            if not self.stream.append(frames):
                return None
            prefix = self.stream.prompt(self.head, None)
            if len(prefix.prompt_token_ids) >= self.max_model_len:
                raise ValueError(
                    f"the session's prefix ({len(prefix.prompt_token_ids)} tokens) would reach max_model_len="
                    f"{self.max_model_len}; open it with a smaller max_frames / max_seconds"
                )
        except BaseException:
            self.stream.restore(before)  # the frames are refused whole
            raise
        return prefix

    def ask_prompt(self, question: str) -> ProcessedPrompt:
        """The prompt a question runs: the prefix, the waiting frames, `<|vision_end|>`, the question, and the
        assistant turn's opening."""
        head, tail = self._split_prompt(question)
        if head != self.head:
            raise ValueError("the chat template changes the text before the video with the question")
        if self.stream.num_frames == 0:
            raise ValueError("the session has no frames yet; append some before asking")
        return self.stream.prompt(self.head, tail)

    def ask(self, question: str, sampling_params: SamplingParams | None = None) -> RequestOutput:
        """Answer a question about the frames seen so far (the window's); a vLLM-shaped RequestOutput."""
        with self._lock:
            self._check_open()
            self.last_used = self.clock()
            processed = self.ask_prompt(question)
            request_id = f"{self.session_id}-ask-{next(self._ids)}"
        try:
            return self.engine.generate(request_id, processed, sampling_params or self.default_sampling_params())
        finally:
            with self._lock:
                self._forget_released()

    def _forget_released(self) -> None:
        released = self.stream.take_released()
        if released:
            self.engine.forget_items(released)

    def close(self) -> None:
        """End the session: its running prefill is dropped and its frames released. Idempotent."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.prefills.abort()
        self.stream.close()
        self._forget_released()

    def expired(self) -> bool:
        """Whether the session has been idle longer than its idle timeout."""
        return self.idle_timeout is not None and self.clock() - self.last_used > self.idle_timeout

    def _check_open(self) -> None:
        if not self.closed and self.expired():
            self._close()
        if self.closed:
            raise ValueError(f"video session {self.session_id} is closed (or expired after idling)")

    def __enter__(self) -> VideoSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class VideoSessions:
    """The open sessions of one engine: at most `max_sessions`; one idle for `idle_timeout` seconds is closed when
    a session is next opened (`expire`). Sessions a caller drops are forgotten (weak references)."""

    def __init__(self, max_sessions: int = 8, idle_timeout: float = 600.0, clock: Callable[[], float] = time.monotonic):
        if max_sessions < 1:
            raise ValueError(f"max_video_sessions must be at least 1, got {max_sessions}")
        if not idle_timeout > 0:
            raise ValueError(f"session_idle_timeout must be positive, got {idle_timeout}")
        self.max_sessions = max_sessions
        self.idle_timeout = idle_timeout
        self.clock = clock
        self.open: weakref.WeakValueDictionary[str, VideoSession] = weakref.WeakValueDictionary()

    def expire(self) -> list[str]:
        """Close the sessions idle longer than `idle_timeout`; returns their ids."""
        expired = [s for s in list(self.open.values()) if not s.closed and s.expired()]
        for s in expired:
            s.close()
        for sid in [sid for sid, s in list(self.open.items()) if s.closed]:
            self.open.pop(sid, None)
        return [s.session_id for s in expired]

    def create(self, engine: SessionEngine, input_processor: Any, max_model_len: int, **kwargs: Any) -> VideoSession:
        """Open a session (kwargs: VideoSession's); ValueError when `max_sessions` are open."""
        self.expire()
        if len(self.open) >= self.max_sessions:
            raise ValueError(f"{len(self.open)} video sessions are open (max_video_sessions={self.max_sessions})")
        sid = f"video-session-{uuid.uuid4().hex}"  # not guessable: a server's clients hold sessions by id
        session = VideoSession(
            sid, engine, input_processor, max_model_len, idle_timeout=self.idle_timeout, clock=self.clock, **kwargs
        )
        self.open[sid] = session
        weakref.finalize(session, session.prefills.abort)
        return session


class _PrefillSlot:
    """A session's running prefill request (if any), kept apart from the session so that a finalizer can abort it
    without keeping the session alive."""

    def __init__(self, engine: SessionEngine):
        self.engine = engine
        self.request_id: str | None = None

    def abort(self) -> None:
        if self.request_id is not None:
            self.engine.abort(self.request_id)
            self.request_id = None


class EngineLoopSessions:
    """`SessionEngine` over an in-process `EngineLoop` (the offline `LLM`): every call runs to its end under `lock`,
    stepping the engine (other requests queued meanwhile run along and are left to their owners)."""

    def __init__(self, engine_loop: EngineLoop, lock: Any):
        self.engine_loop = engine_loop
        self.lock = lock

    def prefill(self, request_id: str, processed: ProcessedPrompt) -> bool:
        self.generate(request_id, processed, _PREFILL_PARAMS)
        return True

    def generate(self, request_id: str, processed: ProcessedPrompt, params: SamplingParams) -> RequestOutput:
        with self.lock:
            self.engine_loop.add_requests([NewRequest(request_id, processed, params, time.time())])
            try:
                while self.engine_loop.has_unfinished_requests():
                    for out in self.engine_loop.step(final_only=True):
                        if out.request_id == request_id and out.finished:
                            return out
            except BaseException:
                self.engine_loop.abort(request_id)
                raise
        raise RuntimeError(f"request {request_id} left the engine without a final output")

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.engine_loop.abort(request_id)

    def forget_items(self, mm_hashes: list[str]) -> None:
        with self.lock:
            self.engine_loop.core.scheduler.encoder_cache.evict(mm_hashes)
