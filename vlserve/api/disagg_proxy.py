"""`vlserve proxy`: disaggregated prefill / decode in front of `vlserve serve` processes (issue 37; the shape of vLLM's
disagg proxy examples).

Each /v1/completions or /v1/chat/completions request goes first to a prefill server (a P2P kv_producer) with
max_tokens=1, stream off and `kv_transfer_params: {"do_remote_decode": true}`; the producer keeps the prompt's KV
blocks and answers with `kv_transfer_params` saying where they are. The original request then goes, with those
params, to a decode server (a P2P kv_consumer), which reads the blocks instead of recomputing the prompt; its answer
(streamed or not) is the client's. Media are encoded on the prefill side only: when the producer's params carry
the expanded prompt and media items (`remote_mm_features`), the decode server gets the messages without their media
parts and takes the prompt from the params. Each list of servers is used round-robin, skipping a server whose last
call failed for a back-off and failing over to the next (`backend_pool.py`); with none left the client gets an
OpenAI-style JSON error, 503 (504 for a timeout). /v1/models comes from a decode server; /health is 200 when every
server's /health is.

    vlserve proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from vlserve.api.backend_pool import BackendPool, NoBackendError
from vlserve.api.errors import error_response

logger = logging.getLogger(__name__)

_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
_FORWARDED_HEADERS = ("authorization", "x-request-id")
_MEDIA_PARTS = ("image_url", "video_url", "audio_url", "input_audio", "image", "video", "audio", "image_pil")


def _without_media(messages: Any) -> Any:
    """The chat messages without their media parts (a part left empty becomes ""): what a decode server gets when
    the prefill server's kv_transfer_params carry the expanded prompt and the media items without their data."""
    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            kept = [p for p in content if not (isinstance(p, dict) and p.get("type") in _MEDIA_PARTS)]
            m = {**m, "content": kept or ""}
        out.append(m)
    return out


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def build_proxy_app(prefill: list[str], decode: list[str], timeout: float = 600.0, backoff_s: float = 5.0):
    """The proxy's FastAPI app over these prefill and decode base URLs (e.g. http://127.0.0.1:8100); a backend
    whose call failed is skipped for `backoff_s` (`backend_pool.BackendPool`)."""
    if not prefill or not decode:
        raise ValueError("the proxy needs at least one --prefill and one --decode server")
    prefill, decode = [_base(u) for u in prefill], [_base(u) for u in decode]
    prefills, decodes = BackendPool("prefill", prefill, backoff_s), BackendPool("decode", decode, backoff_s)
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state["client"] = httpx.AsyncClient(timeout=timeout, trust_env=False)
        try:
            yield
        finally:
            await state["client"].aclose()

    app = FastAPI(title="vlserve disaggregated prefill/decode proxy", lifespan=lifespan)

    def _passthrough(r) -> Response:
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    async def forward(path: str, raw: Request) -> Response:
        try:
            body = json.loads(await raw.body())
        except ValueError as e:
            return error_response(f"invalid JSON body: {e}", 400)
        if not isinstance(body, dict):
            return error_response("the request body must be a JSON object", 400)
        headers = {k: v for k, v in raw.headers.items() if k.lower() in _FORWARDED_HEADERS}
        client = state["client"]
        pre = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        pre.pop("stream_options", None)
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        try:
            p_url, r = await prefills.send(client, "POST", path, json=pre, headers=headers)
        except NoBackendError as e:
            return error_response(str(e), e.status)
        if r.status_code != 200:  # the client's error (or the prefill server's): as the prefill server said it
            return _passthrough(r)
        params = r.json().get("kv_transfer_params")
        if not params:
            return error_response(f"prefill server {p_url} returned no kv_transfer_params (is it started with "
                                  "--kv-transfer-config and kv_role kv_producer?)", 502)
        dec = {**body, "kv_transfer_params": params}
        if params.get("remote_mm_features") and "messages" in body:  # the producer encoded the media: the decode
            dec["messages"] = _without_media(body["messages"])  # server gets its expanded prompt, never the media
        stream = bool(body.get("stream"))
        try:  # (a decode server that fails makes the producer keep the blocks until its send_timeout_s)
            _, resp = await decodes.send(client, "POST", path, stream=stream, json=dec, headers=headers)
        except NoBackendError as e:
            return error_response(str(e), e.status)
        if not stream:
            return _passthrough(resp)
        if resp.status_code != 200:
            await resp.aread()
            await resp.aclose()
            return _passthrough(resp)
        return StreamingResponse(resp.aiter_raw(), status_code=200,
                                 media_type=resp.headers.get("content-type", "text/event-stream"),
                                 background=BackgroundTask(resp.aclose))

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await forward("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await forward("/v1/chat/completions", raw)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        headers = {k: v for k, v in raw.headers.items() if k.lower() in _FORWARDED_HEADERS}
        try:
            return _passthrough((await decodes.send(state["client"], "GET", "/v1/models", headers=headers))[1])
        except NoBackendError as e:
            return error_response(str(e), e.status)

    @app.get("/health")
    async def health() -> Response:
        async def ok(url: str) -> bool:
            try:
                return (await state["client"].get(url + "/health", timeout=5)).status_code == 200
            except httpx.HTTPError:
                return False

        urls = list(dict.fromkeys(prefill + decode))
        results = await asyncio.gather(*(ok(u) for u in urls))
        down = [u for u, good in zip(urls, results) if not good]
        if down:
            return JSONResponse({"status": "unhealthy", "down": down}, status_code=503)
        return Response(status_code=200)

    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vlserve proxy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="base URLs of the prefill servers (vlserve serve with a P2PConnector kv_producer)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="base URLs of the decode servers (vlserve serve with a P2PConnector kv_consumer)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a backend's answer")
    p.add_argument("--backoff", type=float, default=5.0, metavar="SECONDS",
                   help="skip a backend for this long after a call to it failed (it is still tried when every "
                        "backend of its kind is skipped)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    app = build_proxy_app(args.prefill, args.decode, args.timeout, args.backoff)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
