"""`vlserve proxy`: disaggregated serving in front of `vlserve serve` processes (the shape of vLLM's
disagg proxy examples): E/P/D, P/D, or E + PD.

Encode stage (`--encode`, vLLM's E/PD): a chat request with media parts (image_url, video_url, input_audio, ...)
goes first to an encode server (`--mm-encoder-only`, an ec_producer) with max_tokens=1 and stream off; that server
encodes the media, writes the encoder outputs to the shared directory and answers with no tokens. Then the request
goes on as below; the server that next sees the media (an ec_consumer) loads their encoder outputs instead of
running its tower. Text-only requests skip the encode stage. An encode failure (unreachable server, an error
status) is logged and counted (`vlserve:proxy_encode_failures_total` on the proxy's /metrics) and the request goes
on: the consumer encodes on a miss.

Prefill / decode (`--prefill`): each /v1/completions or /v1/chat/completions request goes to a prefill server (a P2P
kv_producer) with max_tokens=1, stream off and `kv_transfer_params: {"do_remote_decode": true}`; the producer keeps
the prompt's KV blocks and answers with `kv_transfer_params` saying where they are. The original request then goes,
with those params, to a decode server (a P2P kv_consumer), which reads the blocks instead of recomputing the prompt;
its answer (streamed or not) is the client's. Media are encoded on the prefill side only: when the producer's params
carry the expanded prompt and media items (`remote_mm_features`), the decode server gets the messages without their
media parts and takes the prompt from the params. Without --prefill the --decode servers prefill and decode
themselves (E + PD: plain servers, ec_consumers), and get the request as the client sent it.

Each list of servers is used round-robin, skipping a server whose last call failed for a back-off and failing over
to the next (`backend_pool.py`); with none left the client gets an OpenAI-style JSON error, 503 (504 for a
timeout). /v1/models comes from a decode server; /health is 200 when every server's /health is; /metrics
(prometheus-client) counts the encode stage.

    vlserve proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
    vlserve proxy --encode http://127.0.0.1:8300 --decode http://127.0.0.1:8200 --port 8000
    vlserve proxy --encode http://127.0.0.1:8300 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
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


def has_media(body: dict) -> bool:
    """Whether a chat request has media parts (what an encode server would encode)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    return any(
        isinstance(p, dict) and p.get("type") in _MEDIA_PARTS
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for p in m["content"]
    )


def _one_token(body: dict) -> dict:
    """The request as a stage that only needs the prompt run gets it: one token, not streamed."""
    out = {**body, "max_tokens": 1, "stream": False}
    out.pop("stream_options", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def build_proxy_app(
    prefill: list[str] | None,
    decode: list[str],
    timeout: float = 600.0,
    encode: list[str] | None = None,
    backoff_s: float = 5.0,
):
    """The proxy's FastAPI app over these base URLs (e.g. http://127.0.0.1:8100): encode servers (optional, for
    requests with media), prefill servers (optional: without them the decode servers prefill too), decode servers;
    a backend whose call failed is skipped for `backoff_s` (`backend_pool.BackendPool`)."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    prefill, encode = list(prefill or []), list(encode or [])
    if not decode:
        raise ValueError("the proxy needs at least one --decode server")
    if not prefill and not encode:
        raise ValueError("the proxy needs --prefill servers, --encode servers or both in front of --decode")
    prefill, decode, encode = [_base(u) for u in prefill], [_base(u) for u in decode], [_base(u) for u in encode]
    encodes, prefills, decodes = (
        BackendPool(role, urls, backoff_s)
        for role, urls in (("encode", encode), ("prefill", prefill), ("decode", decode))
    )
    registry = CollectorRegistry()
    encode_requests = Counter(
        "vlserve:proxy_encode_requests", "requests sent to an encode server first", registry=registry
    )
    encode_failures = Counter(
        "vlserve:proxy_encode_failures",
        "encode stages that failed (the request went on, encoded where it ran)",
        registry=registry,
    )
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state["client"] = httpx.AsyncClient(timeout=timeout, trust_env=False)
        try:
            yield
        finally:
            await state["client"].aclose()

    app = FastAPI(title="vlserve disaggregated serving proxy", lifespan=lifespan)

    def _passthrough(r) -> Response:
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    async def encode_first(path: str, body: dict, headers: dict) -> None:
        """Run the request's media through an encode server (it publishes their encoder outputs); a failure is
        logged and counted, never the client's: the next server encodes what it does not find."""
        encode_requests.inc()
        enc = _one_token(body)
        enc.pop("kv_transfer_params", None)
        try:
            url, r = await encodes.send(state["client"], "POST", path, json=enc, headers=headers)
            why = None if r.status_code == 200 else f"{url}: status {r.status_code}: {r.text[:200]}"
        except NoBackendError as e:
            why = str(e)
        if why is not None:
            encode_failures.inc()
            logger.warning("the encode stage failed (%s); the request goes on and is encoded where it runs", why)

    async def relay(path: str, body: dict, headers: dict) -> Response:
        """The answer of a decode server (failing over to the next), streamed or not."""
        stream = bool(body.get("stream"))
        try:  # (a decode server that fails makes the producer keep the blocks until its send_timeout_s)
            _, resp = await decodes.send(state["client"], "POST", path, stream=stream, json=body, headers=headers)
        except NoBackendError as e:
            return error_response(str(e), e.status)
        if not stream:
            return _passthrough(resp)
        if resp.status_code != 200:
            await resp.aread()
            await resp.aclose()
            return _passthrough(resp)
        return StreamingResponse(
            resp.aiter_raw(),
            status_code=200,
            media_type=resp.headers.get("content-type", "text/event-stream"),
            background=BackgroundTask(resp.aclose),
        )

    async def forward(path: str, raw: Request) -> Response:
        try:
            body = json.loads(await raw.body())
        except ValueError as e:
            return error_response(f"invalid JSON body: {e}", 400)
        if not isinstance(body, dict):
            return error_response("the request body must be a JSON object", 400)
        headers = {k: v for k, v in raw.headers.items() if k.lower() in _FORWARDED_HEADERS}
        if encode and has_media(body):
            await encode_first(path, body, headers)
        if not prefill:  # E + PD: the decode server prefills too
            return await relay(path, body, headers)
        pre = {**_one_token(body), "kv_transfer_params": {"do_remote_decode": True}}
        try:
            p_url, r = await prefills.send(state["client"], "POST", path, json=pre, headers=headers)
        except NoBackendError as e:
            return error_response(str(e), e.status)
        if r.status_code != 200:  # the client's error (or the prefill server's): as the prefill server said it
            return _passthrough(r)
        params = r.json().get("kv_transfer_params")
        if not params:
            return error_response(
                f"prefill server {p_url} returned no kv_transfer_params (is it started with "
                "--kv-transfer-config and kv_role kv_producer?)",
                502,
            )
        dec = {**body, "kv_transfer_params": params}
        if params.get("remote_mm_features") and "messages" in body:  # the producer encoded the media: the decode
            dec["messages"] = _without_media(body["messages"])  # server gets its expanded prompt, never the media
        return await relay(path, dec, headers)

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

        urls = list(dict.fromkeys(encode + prefill + decode))
        results = await asyncio.gather(*(ok(u) for u in urls))
        down = [u for u, good in zip(urls, results) if not good]
        if down:
            return JSONResponse({"status": "unhealthy", "down": down}, status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vlserve proxy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--encode",
        nargs="+",
        default=None,
        metavar="URL",
        help="base URLs of the encode servers (vlserve serve --mm-encoder-only with an ec_producer "
        "--ec-transfer-config): requests with media are encoded there first",
    )
    p.add_argument(
        "--prefill",
        nargs="+",
        default=None,
        metavar="URL",
        help="base URLs of the prefill servers (vlserve serve with a P2PConnector kv_producer); without "
        "them the --decode servers prefill too (E + PD: needs --encode)",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        required=True,
        metavar="URL",
        help="base URLs of the decode servers (a P2PConnector kv_consumer; without --prefill, plain "
        "servers: ec_consumers behind --encode)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a backend's answer")
    p.add_argument(
        "--backoff",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="skip a backend for this long after a call to it failed (it is still tried when every "
        "backend of its kind is skipped)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s %(name)s: %(message)s")
    if not args.prefill and not args.encode:
        build_parser().error("give --prefill servers, --encode servers or both in front of --decode")
    app = build_proxy_app(args.prefill, args.decode, args.timeout, encode=args.encode, backoff_s=args.backoff)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
