"""POST /v1/completions: prompt (string, strings, token ids, lists of token ids) -> completions or an SSE stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vlserve.api.errors import APIError, sse_error, to_api_error
from vlserve.api.media_controls import MediaIOControls
from vlserve.api.prompt_logprobs import prompt_logprobs_body
from vlserve.api.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, random_id
from vlserve.api.request_extras import TokenIdsDelta, check_beam_search_extras, with_prompt_extras
from vlserve.api.serving_base import (
    SSE_DONE,
    DeltaTracker,
    EngineStreamingResponse,
    ServedModels,
    check_fits_context,
    check_kv_transfer_params,
    run_unless_disconnected,
    sse,
    structured_backend,
    usage_of,
)
from vlserve.api.serving_beam import beam_completion, wants_beam_search
from vlserve.api.serving_chat import prepare_input
from vlserve.engine.async_llm import AsyncLLM, RequestStream
from vlserve.engine.generation_config import GenerationDefaults
from vlserve.outputs import Logprob, RequestOutput


def completion_logprobs(
    entries: list[dict[int, Logprob]] | None,
    top_k: int,
    text_start: int,
) -> CompletionLogprobs | None:
    """Legacy completions logprobs (tokens, token_logprobs, top_logprobs, text_offset)."""
    if entries is None:
        return None
    out = CompletionLogprobs()
    offset = text_start
    for entry in entries:
        if not entry:
            continue
        items = list(entry.values())
        sampled = items[0]
        token = sampled.decoded_token or ""
        out.tokens.append(token)
        out.token_logprobs.append(max(sampled.logprob, -9999.0))
        top = sorted((lp for lp in items if lp.rank is not None and lp.rank <= top_k), key=lambda lp: lp.rank)
        out.top_logprobs.append({(t.decoded_token or ""): max(t.logprob, -9999.0) for t in top})
        out.text_offset.append(offset)
        offset += len(token)
    return out


class OpenAIServingCompletion:
    """Validates, processes, queues (one engine request per prompt) and renders completions."""

    def __init__(self, engine: AsyncLLM, models: ServedModels, generation_defaults: GenerationDefaults | None = None):
        self.engine = engine
        self.models = models
        self.generation_defaults = generation_defaults or GenerationDefaults()  # --generation-config
        self.structured_backend = structured_backend(engine)
        self.media_controls = MediaIOControls.from_engine(engine)  # checks media_io_kwargs (prompts carry no media)

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        """Handle one request (errors raise APIError / ValueError, which the app renders as OpenAI errors)."""
        model = self.models.check(req.model)
        lora = self.models.lora_of(model)
        check_kv_transfer_params(self.engine, req, len(req.prompts()))
        self.media_controls.check(req.media_io_kwargs)
        if wants_beam_search(req):
            check_beam_search_extras(req)
            if lora is not None:
                raise APIError("beam search with a LoRA adapter is not supported yet", 400, "model")
            return await beam_completion(
                self.engine, req, raw, model, lambda p: prepare_input(self.engine.process_prompt(p))
            )
        params = req.to_sampling_params(structured_backend=self.structured_backend)
        params = self.generation_defaults.apply_to_request(params, req)
        prompts = req.prompts()
        processed = [
            with_prompt_extras(self.engine, await prepare_input(self.engine.process_prompt(p)), req) for p in prompts
        ]
        echoes = [_prompt_text_of(self.engine, proc) if req.echo else "" for proc in processed]
        for proc in processed:
            check_fits_context(params.max_tokens, len(proc.prompt_token_ids), self.engine.max_model_len)
        request_id = random_id("cmpl")
        streams: list[RequestStream] = []
        try:
            for i, proc in enumerate(processed):
                streams.append(await self.engine.add_request(f"{request_id}-{i}", proc, params, lora, req.priority))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        top_k = req.logprobs or 0
        if req.stream:
            holdback = max((len(s) for s in params.stop), default=1) - 1
            return EngineStreamingResponse(
                self._stream(
                    streams,
                    request_id,
                    model,
                    params.n,
                    top_k,
                    holdback,
                    req.include_usage,
                    echoes,
                    req.return_token_ids,
                )
            )

        def abort_all() -> None:
            for s in streams:
                s.abort()

        try:
            finals = await run_unless_disconnected(raw, asyncio.gather(*(_last(s) for s in streams)), abort_all)
        except BaseException:
            abort_all()
            raise
        token_ids = req.return_token_ids
        choices = [
            CompletionChoice(
                index=p * params.n + c.index,
                text=echoes[p] + c.text,
                logprobs=completion_logprobs(c.logprobs, top_k, 0),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_logprobs=prompt_logprobs_body(out.prompt_logprobs),
                prompt_token_ids=out.prompt_token_ids if token_ids else None,
                token_ids=list(c.token_ids) if token_ids else None,
            )
            for p, out in enumerate(finals)
            for c in out.outputs
        ]
        body = CompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=usage_of(finals),
            kv_transfer_params=finals[0].kv_transfer_params if len(finals) == 1 else None,
        )
        return JSONResponse(body.model_dump())

    async def _stream(
        self,
        streams: list[RequestStream],
        request_id: str,
        model: str,
        n: int,
        top_k: int,
        holdback: int,
        include_usage: bool,
        echoes: list[str] | None = None,
        return_token_ids: bool = False,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        trackers = [DeltaTracker(holdback) for _ in streams]
        echoes = echoes or [""] * len(streams)
        new_token_ids = TokenIdsDelta(return_token_ids)
        started: set[tuple[int, int]] = set()  # (prompt, choice) pairs whose first chunk went out
        finals: dict[int, RequestOutput] = {}
        try:
            async for p, out in _merge(streams):
                finals[p] = out
                choices = []
                for c in out.outputs:
                    if c.index in trackers[p].done:
                        continue
                    finished = c.finish_reason is not None
                    start = trackers[p].sent_text.get(c.index, 0)
                    text, lps = trackers[p].delta(c.index, c.text, c.logprobs, finished)
                    if text or finished or lps:
                        first = (p, c.index) not in started  # its first chunk: the echo and the prompt's ids
                        started.add((p, c.index))
                        choices.append(
                            CompletionChoice(
                                index=p * n + c.index,
                                text=echoes[p] + text if first else text,
                                logprobs=completion_logprobs(lps, top_k, start),
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                                prompt_token_ids=out.prompt_token_ids if first and return_token_ids else None,
                                token_ids=new_token_ids.delta((p, c.index), c.token_ids),
                            )
                        )
                if choices:
                    yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=choices))
            if include_usage:
                yield sse(
                    CompletionResponse(
                        id=request_id,
                        created=created,
                        model=model,
                        choices=[],
                        usage=usage_of([finals[p] for p in sorted(finals)]),
                    )
                )
        except Exception as e:  # noqa: BLE001 -- headers are out: report in-band
            err = to_api_error(e)
            yield sse_error(err.message, err.status)
        finally:
            for s in streams:
                s.abort()
        yield SSE_DONE


def _prompt_text_of(engine: AsyncLLM, processed) -> str:
    """The text `echo` puts first: the prompt's text, or its token ids decoded when it came as ids."""
    if processed.prompt is not None:
        return processed.prompt
    return engine.tokenizer.decode(processed.prompt_token_ids)


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output), in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001
            q.put_nowait((i, e))
        q.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _last(stream: RequestStream) -> RequestOutput:
    last = None
    async with stream:
        async for out in stream:
            last = out
    return last
