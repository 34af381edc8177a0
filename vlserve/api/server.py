"""The OpenAI-compatible HTTP server: app factory (`build_app`), routes, API-key check, and `serve()` (uvicorn).

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (and GET / DELETE
/v1/responses/{id}; see api/responses/), GET /v1/models, GET /health, GET /version, GET /metrics,
POST /tokenize and /detokenize (serving_tokenize.py), the pooling endpoints (POST /v1/embeddings, /pooling,
/v1/score, /v1/rerank; serving_pooling.py), and the playground page (GET /, /playground; see
playground.py) unless `playground` is off; live video sessions (POST /v1/video/sessions, GET / DELETE and a
WebSocket at /v1/video/sessions/{id}; video_sessions.py).
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from vlserve import __version__
from vlserve.api.errors import error_response, install_error_handlers
from vlserve.api.lora_adapters import install_lora_routes, load_adapter, runtime_lora_updating_allowed
from vlserve.api.media import MediaConfig, MediaFetcher
from vlserve.api.metrics import ServerMetrics
from vlserve.api.playground import install_playground
from vlserve.api.protocol import ChatCompletionRequest, CompletionRequest
from vlserve.api.responses import DEFAULT_STORE_SIZE, install_responses_routes
from vlserve.api.serving_base import ServedModels
from vlserve.api.serving_chat import OpenAIServingChat
from vlserve.api.serving_completion import OpenAIServingCompletion
from vlserve.api.serving_pooling import install_pooling_routes
from vlserve.api.serving_tokenize import install_tokenize_routes
from vlserve.api.video_sessions import install_video_session_routes
from vlserve.config import EngineArgs, resolve_model_path
from vlserve.engine.async_llm import AsyncLLM
from vlserve.engine.generation_config import load_generation_defaults

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 64 << 20  # a 20 MB image as a base64 data URL fits; bigger media should come by URL


@dataclass
class ServerConfig:
    """HTTP-side settings (the engine's live in EngineArgs)."""

    served_model_names: list[str] | None = None
    api_key: str | None = None
    media: MediaConfig = field(default_factory=MediaConfig)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    trust_request_chat_template: bool = False  # honour `chat_template` sent in requests (runs client Jinja)
    shutdown_engine: bool = True  # stop the engine thread when the app shuts down
    playground: bool = True  # serve the playground page at / and /playground (--disable-playground)
    enable_auto_tool_choice: bool = False  # tool_choice "auto": the model decides (--enable-auto-tool-choice)
    tool_call_parser: str | None = None  # how tool calls are read from the model's text (--tool-call-parser)
    responses_store_size: int = DEFAULT_STORE_SIZE  # stored Responses kept, LRU (--responses-store-size)


class _GateMiddleware:
    """Pure ASGI (so streaming and disconnects pass through untouched): API key on /v1/*, body-size cap, and
    per-endpoint response counting."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and not self._websocket_key_ok(scope):
            await send({"type": "websocket.close", "code": 1008, "reason": "missing or invalid API key"})  # HTTP 403
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = dict(scope.get("headers") or [])
        rejection = None
        if self.api_key is not None and path.startswith("/v1"):
            auth = headers.get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not token or not hmac.compare_digest(token, self.api_key):
                rejection = error_response("missing or invalid API key (send 'Authorization: Bearer <key>')", 401)
        length = headers.get(b"content-length", b"")
        too_large = error_response(
            f"request body over the {self.max_body_bytes} byte cap (--max-request-body-bytes)", 413
        )
        if rejection is None and length.isdigit() and int(length) > self.max_body_bytes:
            rejection = too_large
        elif (
            rejection is None and not length and scope.get("method") in ("POST", "PUT", "PATCH")
        ):  # chunked: no length to check up front, so count while reading
            body = await _read_body_capped(receive, self.max_body_bytes)
            if body is None:
                rejection = too_large
            else:
                receive = _replay(body, receive)
        if rejection is not None:
            self.metrics.count_http(path, rejection.status_code)
            await rejection(scope, receive, send)
            return

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_http(path, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)

    def _websocket_key_ok(self, scope: Scope) -> bool:
        """A WebSocket on /v1/* carries the key as `Authorization: Bearer` or, as browsers cannot set headers on
        WebSockets, an `api_key` query parameter."""
        if self.api_key is None or not scope["path"].startswith("/v1"):
            return True
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        if not token:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            token = query.get("api_key", [""])[0].encode()
        return bool(token) and hmac.compare_digest(token, self.api_key)


async def _read_body_capped(receive: Receive, cap: int) -> bytes | None:
    """The whole request body, or None as soon as it grows past `cap` bytes."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break  # disconnected: the app will see an empty body and the disconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > cap:
            return None
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that first hands over the already-read body, then passes through (disconnect notices)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


def default_model_names(engine: AsyncLLM) -> list[str]:
    """`--served-model-name`, else the model argument as given, else "vlserve-demo" (the embedded demo model)."""
    args = engine.engine_args
    if args.served_model_name:
        return [args.served_model_name]
    return [args.model or "vlserve-demo"]


def build_app(engine: AsyncLLM, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (which must already be running)."""
    config = config or ServerConfig()
    names = config.served_model_names or default_model_names(engine)
    models = ServedModels(names, engine.engine.loaded.model_path, engine.max_model_len)
    fetcher = MediaFetcher(config.media)
    metrics = ServerMetrics(engine)
    generation_defaults = load_generation_defaults(engine.engine_args.generation_config, models.root)
    logger.info("%s", generation_defaults.describe())
    chat = OpenAIServingChat(
        engine,
        models,
        fetcher,
        config.trust_request_chat_template,
        enable_auto_tool_choice=config.enable_auto_tool_choice,
        tool_call_parser=config.tool_call_parser,
        generation_defaults=generation_defaults,
    )
    completion = OpenAIServingCompletion(engine, models, generation_defaults)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        for name, path in (engine.engine_args.lora_modules or {}).items():  # --lora-modules: loaded before serving
            await load_adapter(engine, models, name, path)
        yield
        await fetcher.aclose()
        if config.shutdown_engine:
            engine.shutdown()

    app = FastAPI(title="vlserve", version=__version__, lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.models = engine, metrics, models
    install_error_handlers(app)
    install_pooling_routes(app, chat, models)  # before the gate: its middleware must sit inside the gate's
    app.add_middleware(_GateMiddleware, api_key=config.api_key, max_body_bytes=config.max_body_bytes, metrics=metrics)

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine thread runs, 503 once it stopped."""
        if engine.is_running:
            return Response(status_code=200)
        return error_response("the engine is not running", 503)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(models.list().model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(body, raw)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await completion.create(body, raw)

    install_tokenize_routes(app, chat, models)
    install_responses_routes(app, chat, config.responses_store_size)
    install_video_session_routes(app, engine, models, generation_defaults, config.trust_request_chat_template)
    if runtime_lora_updating_allowed():
        install_lora_routes(app, engine, models)
    if config.playground:
        install_playground(app, models, engine.modalities)
    return app


def serve(
    engine_args: EngineArgs,
    host: str = "127.0.0.1",
    port: int = 8000,
    config: ServerConfig | None = None,
    log_level: str = "info",
    engine_process: bool = True,
) -> int:
    """Load the model, then serve until interrupted (Ctrl-C / SIGTERM) or until the engine dies.

    `engine_process`: run the engine core in its own process (default, like vLLM v1) or in a thread of this one.
    Returns the exit code: 0 after a normal stop, 1 when the engine died (its open requests got 5xx first).
    """
    import uvicorn

    if not engine_process and engine_args.data_parallel_size > 1:
        raise ValueError(
            f"--data-parallel-size {engine_args.data_parallel_size} needs engine processes; it cannot "
            "be combined with --no-engine-process"
        )
    load_generation_defaults(engine_args.generation_config, resolve_model_path(engine_args.model))  # fail early
    if engine_process:
        from vlserve.engine.mp_async_llm import MPAsyncLLM

        engine: AsyncLLM = MPAsyncLLM.from_engine_args(engine_args)
    else:
        engine = AsyncLLM.from_engine_args(engine_args)
    app = build_app(engine, config)
    logger.info(
        "serving %s on http://%s:%d (pid %d, engine %s)",
        app.state.models.names[0],
        host,
        port,
        os.getpid(),
        f"processes x{engine_args.data_parallel_size}" if engine_process else "thread",
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=host, port=port, log_level=log_level, timeout_keep_alive=30, timeout_graceful_shutdown=10
        )
    )
    died = threading.Event()

    def stop_when_engine_dies() -> None:
        while not server.should_exit:
            if not engine.is_running:
                logger.error("the engine stopped; shutting the server down")
                died.set()
                server.should_exit = True
                return
            time.sleep(0.25)

    threading.Thread(target=stop_when_engine_dies, name="vlserve-engine-watch", daemon=True).start()
    try:
        server.run()
    finally:
        engine.shutdown()
    return 1 if died.is_set() else 0
