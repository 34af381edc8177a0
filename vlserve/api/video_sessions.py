"""Live video sessions over HTTP: REST routes to open, read and delete a session, and a WebSocket that streams
frames in and answers out (vlserve.engine.async_video_session drives the engine; video_protocol.py the messages).

- `POST /v1/video/sessions` {model?, messages?, fps, max_frames?, max_seconds?, window_slack?,
  mm_processor_kwargs?, chat_template_kwargs?} -> the session object; 400 naming the field (unknown fields too, a
  model without video sessions), 429 while `--max-video-sessions` are open.
- `GET /v1/video/sessions/{id}` -> the session object (frames seen, frames in the window); 404 unknown.
- `DELETE /v1/video/sessions/{id}` -> `{"id", "object": "video.session.deleted", "deleted": true}`, once its
  prefill and answers are aborted and its encoder entries evicted.
- WebSocket `/v1/video/sessions/{id}`: binary messages are encoded frames; text messages are JSON
  (`frames.append`, `question`, `session.close`). The server sends `session.ready`, `frames.appended`,
  `answer.delta`, `answer.done`, `error` (the connection stays open) and `session.closed` (then closes with 1000).
  An unknown id: an error, then close code 4404. A client that disconnects leaves the session open (another
  connection may attach) until its idle timeout (`--session-idle-timeout`) or DELETE; its running answers are
  aborted. Messages are handled in arrival order, but an answer streams alongside later appends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from fastapi import FastAPI, WebSocket
from fastapi.responses import JSONResponse
from starlette.websockets import WebSocketDisconnect

from vlserve.api.errors import APIError, to_api_error
from vlserve.api.serving_base import DeltaTracker, ServedModels
from vlserve.api.video_protocol import (
    FramesAppend,
    Question,
    SessionClose,
    VideoSessionRequest,
    data_url_bytes,
    decode_frame,
    error_message,
    parse_message,
    question_id_of,
)
from vlserve.engine.async_video_session import AsyncVideoSession, AsyncVideoSessions
from vlserve.engine.generation_config import GenerationDefaults
from vlserve.engine.request_limits import check_chat_template_kwargs
from vlserve.shorten import shorten

logger = logging.getLogger(__name__)

_INBOX_SIZE = 32  # messages read ahead of the worker per connection
SESSION_NOT_FOUND = 4404  # the WebSocket close code for an unknown (closed, expired) session id
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
# what VideoSession's refusals say -> the field of the request body they are about (the first that matches)
_SESSION_PARAMS = (
    ("window_slack", "window_slack"),
    ("max_seconds", "max_seconds"),
    ("not sampled", "mm_processor_kwargs"),
    ("fps", "fps"),
    ("max_frames", "max_frames"),
    ("the window must hold", "max_frames"),
    ("chat_template_kwargs", "chat_template_kwargs"),
    ("messages", "messages"),
    ("takes no video", "model"),
    ("families", "model"),
)


def install_video_session_routes(
    app: FastAPI,
    engine: Any,
    models: ServedModels,
    generation_defaults: GenerationDefaults | None = None,
    trust_request_chat_template: bool = False,
) -> AsyncVideoSessions:
    """The REST routes and the WebSocket of live video sessions on `engine` (an AsyncLLM or MPAsyncLLM); bounds
    from its EngineArgs (`max_video_sessions`, `session_idle_timeout`). Returns the session registry."""
    args = engine.engine_args
    sessions = AsyncVideoSessions(engine, args.max_video_sessions, args.session_idle_timeout)
    defaults = generation_defaults or GenerationDefaults()
    reaper = _Reaper(sessions, period=min(30.0, args.session_idle_timeout / 4))
    app.state.video_sessions = sessions

    @app.post("/v1/video/sessions")
    async def create_video_session(body: VideoSessionRequest) -> JSONResponse:
        model = models.check(body.model)
        if models.lora_of(model) is not None:
            raise APIError("video sessions run the base model, not a LoRA adapter", 400, "model")
        if await sessions.is_full():
            raise APIError(
                f"{len(sessions.open)} video sessions are open (--max-video-sessions {sessions.max_sessions}); "
                "close one (DELETE /v1/video/sessions/{id}) or retry later",
                429,
            )
        try:
            template_kwargs = check_chat_template_kwargs(body.chat_template_kwargs, trust_request_chat_template)
            session = await sessions.create(
                model,
                int(time.time()),
                messages=[m.model_dump() for m in body.messages or []],
                fps=body.fps,
                max_frames=body.max_frames,
                max_seconds=body.max_seconds,
                window_slack=body.window_slack,
                mm_processor_kwargs=body.mm_processor_kwargs,
                chat_template_kwargs=template_kwargs,
            )
        except ValueError as e:
            message = str(e)
            raise APIError(message, 400, _session_param(message)) from None
        reaper.ensure_running()
        return JSONResponse(session.describe())

    @app.get("/v1/video/sessions/{session_id}")
    async def get_video_session(session_id: str) -> JSONResponse:
        return JSONResponse((await _open_session(sessions, session_id)).describe())

    @app.delete("/v1/video/sessions/{session_id}")
    async def delete_video_session(session_id: str) -> JSONResponse:
        await _open_session(sessions, session_id)
        await sessions.close(session_id, "deleted")
        return JSONResponse({"id": session_id, "object": "video.session.deleted", "deleted": True})

    @app.websocket("/v1/video/sessions/{session_id}")
    async def video_session_socket(ws: WebSocket, session_id: str) -> None:
        await ws.accept()
        session = await sessions.get(session_id)
        if session is None:
            await ws.send_json(error_message(_not_found(session_id)))
            await ws.close(SESSION_NOT_FOUND)
            return
        await _SessionSocket(ws, session, sessions, defaults).run()

    return sessions


def _session_param(message: str) -> str | None:
    return next((param for words, param in _SESSION_PARAMS if words in message), None)


def _not_found(session_id: str) -> APIError:
    return APIError(f"no open video session {shorten(session_id)} (closed, expired or never opened)", 404, "id")


async def _open_session(sessions: AsyncVideoSessions, session_id: str) -> AsyncVideoSession:
    session = await sessions.get(session_id)
    if session is None:
        raise _not_found(session_id)
    return session


class _SessionSocket:
    """One WebSocket attached to a session: a reader queues appends and questions in arrival order, a worker
    applies them (a question's prompt is built in turn, its answer then streams as a task of its own)."""

    def __init__(self, ws: WebSocket, session: AsyncVideoSession, sessions: AsyncVideoSessions, defaults):
        self.ws = ws
        self.session = session
        self.sessions = sessions
        self.defaults = defaults
        self.inbox: asyncio.Queue = asyncio.Queue(_INBOX_SIZE)  # full: the reader waits, and so does the client
        self.answers: set[asyncio.Task] = set()
        self.send_lock = asyncio.Lock()
        self.question_ids = 0

    async def send(self, message: dict) -> None:
        async with self.send_lock:
            await self.ws.send_json(message)

    async def run(self) -> None:
        await self.send({"type": "session.ready", "session": self.session.describe()})
        tasks = [asyncio.create_task(t) for t in (self._read(), self._work(), self.session.closed.wait())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:  # nothing awaited here: the server may be cancelling this handler
            for task in tasks + list(self.answers):
                task.cancel()
                task.add_done_callback(_consume)
        if self.session.closed.is_set():
            with contextlib.suppress(WebSocketDisconnect, RuntimeError):  # the client may be gone already
                await self.send(
                    {"type": "session.closed", "id": self.session.session_id, "reason": self.session.close_reason}
                )
                await self.ws.close(1000)

    async def _read(self) -> None:
        """Read until the client leaves or closes the session."""
        while True:
            msg = await self.ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            if msg.get("bytes") is not None:
                await self.inbox.put(("frames", [msg["bytes"]], None))
                continue
            text = msg.get("text") or ""
            try:
                parsed = parse_message(text)
                if isinstance(parsed, Question):
                    params = parsed.sampling_params(self.defaults)
            except (APIError, ValueError) as e:
                await self.send(error_message(_sampling_error(e), question_id_of(text)))
                continue
            if isinstance(parsed, SessionClose):
                await self.sessions.close(self.session.session_id, "closed")
                return
            if isinstance(parsed, FramesAppend):
                await self.inbox.put(("frames", parsed.frames, None))
            else:
                self.question_ids += 1
                parsed.question_id = parsed.question_id or f"q-{self.question_ids}"
                await self.inbox.put(("question", parsed, (params, time.monotonic())))

    async def _work(self) -> None:
        while True:
            kind, payload, extra = await self.inbox.get()
            if kind == "frames":
                await self._append(payload)
            else:
                await self._ask(payload, *extra)

    async def _append(self, frames: list) -> None:
        try:
            arrays = await self.session.llm._in_pool(self._decode, frames)
            await self.session.append(arrays)
        except Exception as e:
            await self.send(error_message(_frame_error(e)))
            return
        stream = self.session.session.stream
        await self.send({"type": "frames.appended", "frames": stream.frames_seen, "window_frames": stream.num_frames})

    def _decode(self, frames: list) -> list:
        """Encoded frames (bytes, or data URLs) -> [H, W, 3] uint8 arrays, in the preprocessing pool."""
        max_pixels = self.session.llm.input_processor.mm_processor.max_image_pixels
        out = []
        for i, frame in enumerate(frames):
            data = frame if isinstance(frame, bytes) else data_url_bytes(frame, i)
            out.append(decode_frame(data, max_pixels, "the frame" if isinstance(frame, bytes) else f"frames[{i}]"))
        return out

    async def _ask(self, question: Question, params, arrival: float) -> None:
        try:
            prepared = await self.session.prepare_question(question.question)
        except Exception as e:
            await self.send(error_message(to_api_error(e), question.question_id))
            return
        task = asyncio.create_task(self._answer(question, params, prepared, arrival))
        self.answers.add(task)
        task.add_done_callback(self.answers.discard)

    async def _answer(self, question: Question, params, prepared, arrival: float) -> None:
        qid = question.question_id
        tracker = DeltaTracker(max((len(s) for s in params.stop), default=1) - 1)
        first_token, last = None, None
        try:
            async with contextlib.aclosing(self.session.answer(prepared, params)) as outputs:
                async for out in outputs:
                    last, choice = out, out.outputs[0]
                    if first_token is None and choice.token_ids:
                        first_token = time.monotonic()
                    delta, _ = tracker.delta(0, choice.text, None, out.finished)
                    if delta:
                        await self.send({"type": "answer.delta", "question_id": qid, "delta": delta})
        except (WebSocketDisconnect, RuntimeError) as e:
            if isinstance(e, RuntimeError) and not _is_closed_socket(e):
                await self.send(error_message(to_api_error(e), qid))
            return
        except Exception as e:
            await self.send(error_message(to_api_error(e), qid))
            return
        choice = last.outputs[0]
        await self.send(
            {
                "type": "answer.done",
                "question_id": qid,
                "text": choice.text,
                "finish_reason": choice.finish_reason,
                "usage": {
                    "prompt_tokens": len(last.prompt_token_ids),
                    "completion_tokens": len(choice.token_ids),
                    "total_tokens": len(last.prompt_token_ids) + len(choice.token_ids),
                    "prompt_tokens_details": {"cached_tokens": last.num_cached_tokens},
                },
                "frames": prepared.num_frames,
                "ttft_ms": None if first_token is None else round((first_token - arrival) * 1000, 1),
            }
        )


def _consume(task: asyncio.Task) -> None:
    """Retrieve a finished task's exception (a cancelled handler's tasks end unobserved)."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("video session socket task ended with %r", task.exception())


def _sampling_error(e: Exception) -> APIError:
    err = to_api_error(e)
    if err.param is None:
        err.param = next((f for f in _SAMPLING_FIELDS if err.message.startswith(f)), None)
    return err


def _is_closed_socket(e: RuntimeError) -> bool:
    """Starlette's RuntimeError for a send on a socket that is already closed."""
    return "close" in str(e) or "disconnect" in str(e)


def _frame_error(e: Exception) -> APIError:
    err = to_api_error(e)
    if err.status == 400 and err.param is None:
        err.param = "frames"
    return err


class _Reaper:
    """Closes idle sessions every `period` seconds while any is open (a task on the serving loop, started by the
    first session and ended with the last)."""

    def __init__(self, sessions: AsyncVideoSessions, period: float):
        self.sessions = sessions
        self.period = period
        self.task: asyncio.Task | None = None

    def ensure_running(self) -> None:
        loop = asyncio.get_running_loop()
        if self.task is None or self.task.done() or self.task.get_loop() is not loop:
            self.task = loop.create_task(self._run())

    async def _run(self) -> None:
        while self.sessions.open:
            await asyncio.sleep(self.period)
            try:
                await self.sessions.sweep()
            except Exception:
                logger.exception("closing idle video sessions failed")
