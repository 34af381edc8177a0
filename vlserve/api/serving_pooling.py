"""The pooling runner's HTTP endpoints (vLLM's and OpenAI's shapes), installed by `install_pooling_routes`:

- POST /v1/embeddings: `input` (string, strings, token ids, lists of token ids) or chat `messages` (rendered and
  their media fetched by the chat endpoint's own input side) -> `{"object": "list", "data": [{"object":
  "embedding", "index", "embedding"}], "model", "usage"}`; `encoding_format` "base64" gives each embedding as
  little-endian float32 bytes (what the `openai` client decodes), `dimensions` a Matryoshka truncation (a 400 on a
  model that declares none).
- POST /pooling: the same inputs -> the raw pooled output per prompt (`{"object": "pooling", "data": [...]}`),
  task from the request's `task` or "encode".
- POST /v1/score (and /score): query / document pairs -> `{"object": "score", "score"}` per pair; POST /v1/rerank
  (and /rerank, /v2/rerank): `query` against `documents` -> results sorted by `relevance_score`, best first. Both
  build their pairs with `vlserve.engine.scoring`, as `LLM.score` does.
- GET /v1/models: each card carries `"tasks"`, the tasks this server serves (["generate"], or the pooling engine's
  PoolingParams tasks, e.g. ["embed", "encode"]); vLLM's cards have no such field.

A pooling server answers the generation endpoints (/v1/chat/completions, /v1/completions, /v1/responses) with a
400, and a generation server these endpoints likewise. A dual-tower embedder (CLIP / SigLIP) takes `messages`
whose one input is a single text or image part.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from vlserve.api.errors import APIError, error_response
from vlserve.api.media import PASSTHROUGH_PARTS, URL_PARTS
from vlserve.api.pooling_protocol import EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest
from vlserve.api.protocol import ChatCompletionRequest, random_id
from vlserve.api.serving_base import ServedModels, check_mm_processor_kwargs, run_unless_disconnected
from vlserve.api.serving_chat import OpenAIServingChat, prepare_input
from vlserve.engine.input_processor import ChatTemplateOptions, ProcessedPrompt
from vlserve.engine.request_limits import check_prompt_chars
from vlserve.engine.scoring import (
    SCORE_CHAT_OPTIONS,
    ChatPrompt,
    ScorePrompt,
    TextPairPrompt,
    TextPrompt,
    dual_tower_prompt,
    is_dual_tower,
    plan_scores,
    process_text_pair,
    scores_from_outputs,
)
from vlserve.outputs import PoolingRequestOutput
from vlserve.pooling_params import PoolingParams

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def served_tasks(engine: Any) -> list[str]:
    """What /v1/models reports a server serves: ["generate"], or the pooling engine's tasks."""
    return ["generate"] if engine.runner_type != "pooling" else sorted(engine.pooling_tasks)


def encode_vector(data: Any, encoding_format: str) -> Any:
    """A pooled tensor as the response carries it: nested floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(data, dtype="<f4").tobytes()).decode("ascii")
    return data.tolist()


class OpenAIServingPooling:
    """Validates, processes (through the chat endpoint's input side for messages and media), pools and renders."""

    def __init__(self, chat: OpenAIServingChat, models: ServedModels):
        self.chat = chat
        self.engine = chat.engine
        self.models = models
        self.dual_tower = self.engine.runner_type == "pooling" and is_dual_tower(self.engine.engine.loaded.hf_config)

    def _check_pooling(self, endpoint: str) -> None:
        if self.engine.runner_type != "pooling":
            raise APIError(
                f"this server runs the generation runner; {endpoint} needs a pooling model "
                "(start the server with --runner pooling)",
                400,
            )

    # -- inputs ------------------------------------------------------------------------------------------------
    async def _process_text(self, text: str, add_special_tokens: bool) -> ProcessedPrompt:
        if add_special_tokens:
            return await prepare_input(self.engine.process_prompt(text))
        processor = self.engine.input_processor

        def tokenize() -> ProcessedPrompt:
            check_prompt_chars(text, processor.max_prompt_chars, self.engine.max_model_len)
            ids = list(self.engine.tokenizer(text, add_special_tokens=False)["input_ids"])
            if not ids:
                raise ValueError("the prompt is empty; give at least one token")
            return ProcessedPrompt(text, ids, [])

        return await prepare_input(asyncio.to_thread(tokenize))

    async def _process_inputs(self, req: EmbeddingRequest | PoolingRequest) -> list[ProcessedPrompt]:
        """The request's prompts: each `input` entry, or its `messages` as one prompt."""
        if req.messages is None:
            try:
                items = req.inputs()
            except ValueError as e:
                raise APIError(str(e), 400, "input") from None
            if req.add_special_tokens is not None and not isinstance(items[0], str):
                raise APIError("add_special_tokens applies to text input, not token ids", 400, "add_special_tokens")
            add_special = req.add_special_tokens is not False
            return [
                await (
                    self._process_text(item, add_special)
                    if isinstance(item, str)
                    else prepare_input(self.engine.process_prompt({"prompt_token_ids": item}))
                )
                for item in items
            ]
        chat_req = req.as_chat_request()
        if self.dual_tower:
            template_fields = (
                "chat_template",
                "chat_template_kwargs",
                "add_generation_prompt",
                "continue_final_message",
            )
            sent = next((n for n in template_fields if getattr(req, n)), None)
            if sent is not None:
                raise APIError(f"{sent}: a dual-tower embedder renders no chat template", 400, sent)
            return [await self._dual_tower(chat_req, "messages")]
        options = ChatTemplateOptions(
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            add_special_tokens=bool(req.add_special_tokens),
        )
        return [await self.chat._process(chat_req, None, options)]

    async def _dual_tower(self, chat_req: ChatCompletionRequest, field: str) -> ProcessedPrompt:
        """A dual tower's one text or image (the one message's one part) as its prompt."""
        messages = chat_req.messages_as_dicts()
        content = messages[0]["content"] if len(messages) == 1 else None
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise APIError("a dual-tower embedder takes one message holding one text or one image part", 400, field)
        self.chat._check_media(messages)
        mm_kwargs = check_mm_processor_kwargs(chat_req.mm_processor_kwargs, self.chat.mm_kwarg_limits)
        payloads = await self.chat.fetcher.resolve(messages)
        source = self.chat.media_controls.media_source(payloads)
        try:
            prompt = dual_tower_prompt(parts, source)
        except ValueError as e:
            raise APIError(str(e), 400, field) from None
        return await prepare_input(self.engine.process_prompt(prompt, mm_processor_kwargs=mm_kwargs))

    def _check_parts(self, prompt: ChatPrompt, field: str) -> None:
        """400 naming `field` for media this model does not take (before any download)."""
        for part in prompt.parts:
            modality = (URL_PARTS | PASSTHROUGH_PARTS).get(part.get("type"))
            if modality is not None and modality not in self.engine.modalities:
                what = ", ".join(self.engine.modalities) or "text only"
                raise APIError(f"{modality} input is not supported by this model (it takes: {what})", 400, field)

    async def _process_score_prompt(self, prompt: ScorePrompt, mm_kwargs: dict | None, field: str) -> ProcessedPrompt:
        if isinstance(prompt, TextPrompt):
            return await self._process_text(prompt.text, True)
        if isinstance(prompt, TextPairPrompt):
            return await prepare_input(asyncio.to_thread(process_text_pair, self.engine.input_processor, prompt))
        self._check_parts(prompt, field)
        try:
            chat_req = ChatCompletionRequest(messages=prompt.messages(), mm_processor_kwargs=mm_kwargs)
        except ValueError as e:
            raise APIError(f"{field}: {e}", 400, field) from None
        if self.dual_tower:
            return await self._dual_tower(chat_req, field)
        return await self.chat._process(chat_req, None, SCORE_CHAT_OPTIONS)

    def _truncate(self, prompts: list[ProcessedPrompt], num_tokens: int | None) -> list[ProcessedPrompt]:
        try:
            return [self.engine.input_processor.truncate_prompt(p, num_tokens) for p in prompts]
        except ValueError as e:
            raise APIError(str(e), 400, "truncate_prompt_tokens") from None

    # -- the engine --------------------------------------------------------------------------------------------
    async def _pool(
        self, raw: Request, prompts: list[ProcessedPrompt], params: PoolingParams, model: str, priority: int
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt with `params`; all or none are queued, and a disconnect aborts them."""
        lora = self.models.lora_of(model)
        streams = []
        try:
            for prompt in prompts:
                streams.append(await self.engine.add_pooling_request(random_id("pool"), prompt, params, lora, priority))
        except BaseException as e:
            for stream in streams:
                stream.abort()
            if isinstance(e, ValueError):
                raise APIError(str(e), 400, _param_of(str(e), params)) from None
            raise

        async def collect() -> list[PoolingRequestOutput]:
            return [[out async for out in stream][-1] for stream in streams]

        def abort_all() -> None:
            for stream in streams:
                stream.abort()

        return await run_unless_disconnected(raw, collect(), abort_all)

    # -- endpoints ---------------------------------------------------------------------------------------------
    async def embeddings(self, req: EmbeddingRequest, raw: Request) -> dict:
        self._check_pooling("/v1/embeddings")
        model = self.models.check(req.model)
        params = PoolingParams(task="embed", dimensions=req.dimensions, normalize=req.normalize)
        prompts = self._truncate(await self._process_inputs(req), req.truncate_prompt_tokens)
        outs = await self._pool(raw, prompts, params, model, req.priority)
        data = [
            {"object": "embedding", "index": i, "embedding": encode_vector(o.outputs.data, req.encoding_format)}
            for i, o in enumerate(outs)
        ]
        return _listing("embd", model, data, outs)

    async def pooling(self, req: PoolingRequest, raw: Request) -> dict:
        self._check_pooling("/pooling")
        model = self.models.check(req.model)
        task = req.task or "encode"
        if req.normalize is not None and task not in ("embed", "encode"):
            raise APIError(f"normalize applies to tasks embed and encode, not {task}", 400, "normalize")
        if req.use_activation is not None and task not in ("classify", "score"):
            raise APIError(f"use_activation applies to tasks classify and score, not {task}", 400, "use_activation")
        params = PoolingParams(
            task=task, dimensions=req.dimensions, normalize=req.normalize, activation=req.use_activation
        )
        prompts = self._truncate(await self._process_inputs(req), req.truncate_prompt_tokens)
        outs = await self._pool(raw, prompts, params, model, req.priority)
        data = [
            {"object": "pooling", "index": i, "data": encode_vector(o.outputs.data, req.encoding_format)}
            for i, o in enumerate(outs)
        ]
        return _listing("pool", model, data, outs)

    async def _scores(self, req: ScoreRequest | RerankRequest, raw: Request, names, data_1, data_2):
        """(model, pair scores, pooled outputs) for `data_1` against `data_2`."""
        model = self.models.check(req.model)
        try:
            plan = plan_scores(data_1, data_2, self.engine.pooling_tasks, names)
        except ValueError as e:
            raise APIError(str(e), 400, _field_in(str(e), names)) from None
        if req.use_activation is not None and plan.task != "score":
            raise APIError("use_activation applies to a classifier's scores; this model embeds", 400, "use_activation")
        mm_kwargs = check_mm_processor_kwargs(req.mm_processor_kwargs, self.chat.mm_kwarg_limits)
        field_of = _prompt_fields(plan, names)
        prompts = [await self._process_score_prompt(p, mm_kwargs, field_of[i]) for i, p in enumerate(plan.prompts)]
        prompts = self._truncate(prompts, req.truncate_prompt_tokens)
        params = PoolingParams(task=plan.task, activation=req.use_activation)
        outs = await self._pool(raw, prompts, params, model, req.priority)
        return model, scores_from_outputs(plan, outs), outs

    async def score(self, req: ScoreRequest, raw: Request) -> dict:
        self._check_pooling("/v1/score")
        names, data_1, data_2 = req.sides()
        model, scores, outs = await self._scores(req, raw, names, data_1, data_2)
        data = [{"object": "score", "index": i, "score": s.outputs.score} for i, s in enumerate(scores)]
        return _listing("score", model, data, outs)

    async def rerank(self, req: RerankRequest, raw: Request) -> dict:
        self._check_pooling("/v1/rerank")
        if isinstance(req.query, list):
            raise APIError("query must be one string or one {'content': [...]} object", 400, "query")
        query = [req.query] if isinstance(req.query, dict) else req.query  # one input, all its parts
        model, scores, outs = await self._scores(req, raw, ("query", "documents"), query, req.documents)
        documents = _rerank_documents(req.documents)
        order = sorted(range(len(scores)), key=lambda i: -scores[i].outputs.score)
        if req.top_n:
            order = order[: req.top_n]
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i].outputs.score}
            if req.return_documents:
                result["document"] = documents[i]
            results.append(result)
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return {
            "id": random_id("rerank"),
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results,
        }


def _listing(prefix: str, model: str, data: list[dict], outs: list[PoolingRequestOutput]) -> dict:
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {
        "id": random_id(prefix),
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }


def _rerank_documents(documents: Any) -> list[dict]:
    """Each document as a rerank result shows it: `{"text"}` or `{"multi_modal": [parts]}` (after the inputs
    passed `plan_scores`, which checked their shapes)."""
    if isinstance(documents, str):
        documents = [documents]
    elif isinstance(documents, dict):
        documents = [{"content": [part]} for part in documents["content"]]
    return [{"text": d} if isinstance(d, str) else {"multi_modal": d["content"]} for d in documents]


def _field_in(message: str, names: tuple[str, str]) -> str | None:
    """The side a scoring error names (its messages start with the field)."""
    return next((n for n in names if message.startswith(n)), None)


def _prompt_fields(plan, names: tuple[str, str]) -> list[str]:
    """The request field each of the plan's prompts comes from (for errors): a pair's prompt names the document
    side, an embedder's prompt the side that first used it."""
    fields = [names[1]] * len(plan.prompts)
    if plan.task == "embed":
        for pair in plan.pairs:
            fields[pair[0]] = names[0]
    return fields


def _param_of(message: str, params: PoolingParams) -> str | None:
    """The request field an engine refusal is about."""
    if params.dimensions is not None and "dimensions" in message:
        return "dimensions"
    if "truncate" in message:
        return "truncate_prompt_tokens"
    return None


class _GenerationRefusal:
    """Pure ASGI: on a pooling server, POSTs to the generation endpoints get an OpenAI-style 400."""

    def __init__(self, app: ASGIApp, engine: Any):
        self.app = app
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope.get("method") == "POST"
            and scope["path"] in GENERATION_PATHS
            and self.engine.runner_type == "pooling"
        ):
            tasks = ", ".join(sorted(self.engine.pooling_tasks))
            response = error_response(
                f"this server runs the pooling runner ({tasks}); {scope['path']} needs a generation model. Use "
                "/v1/embeddings, /v1/score, /v1/rerank or /pooling",
                400,
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def install_pooling_routes(app: FastAPI, chat: OpenAIServingChat, models: ServedModels) -> None:
    """The pooling endpoints, the tasks on /v1/models' cards, and the generation endpoints' refusal on a pooling
    server (a middleware: install before the API-key gate, so the gate stays outermost)."""
    serving = OpenAIServingPooling(chat, models)
    models.tasks = served_tasks(chat.engine)
    app.add_middleware(_GenerationRefusal, engine=chat.engine)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request) -> JSONResponse:
        return JSONResponse(await serving.embeddings(body, raw))

    @app.post("/pooling")
    async def pooling(body: PoolingRequest, raw: Request) -> JSONResponse:
        return JSONResponse(await serving.pooling(body, raw))

    async def score(body: ScoreRequest, raw: Request) -> JSONResponse:
        return JSONResponse(await serving.score(body, raw))

    async def rerank(body: RerankRequest, raw: Request) -> JSONResponse:
        return JSONResponse(await serving.rerank(body, raw))

    for path in ("/v1/score", "/score"):
        app.post(path)(score)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.post(path)(rerank)
