"""POST /v1/responses, GET and DELETE /v1/responses/{id}: a Responses request runs through the chat endpoint's
input side (OpenAIServingChat.prepare: chat template, media, tools, output constraint, sampling) and its output
comes back as Response output items, whole or as streamed events."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from vlserve.api.errors import APIError, to_api_error
from vlserve.api.responses.convert import chat_request, history_messages
from vlserve.api.responses.output import finish, initial_response, item_status, output_items
from vlserve.api.responses.protocol import ResponseObject, ResponsesRequest
from vlserve.api.responses.reasoning import PromptReasoning, split_reasoning
from vlserve.api.responses.store import DEFAULT_STORE_SIZE, ResponseStore, StoredResponse
from vlserve.api.responses.streaming import EventWriter, OutputStreamer
from vlserve.api.serving_base import DeltaTracker, EngineStreamingResponse, run_unless_disconnected
from vlserve.api.serving_chat import OpenAIServingChat, last_output
from vlserve.api.tool_choice import ToolPlan
from vlserve.engine.async_llm import RequestStream
from vlserve.outputs import RequestOutput
from vlserve.shorten import shorten


class OpenAIServingResponses:
    """Runs Responses requests on the chat endpoint's input processing; keeps stored ones in `store`.
    `reasoning_parser`: a factory of a fresh reasoning parser per request (None: the chat endpoint's parser, from
    --reasoning-parser, if the server has one; else no reasoning items)."""

    def __init__(
        self, chat: OpenAIServingChat, store: ResponseStore, reasoning_parser: Callable[[], Any] | None = None
    ):
        self.chat = chat
        self.engine = chat.engine
        self.store = store
        self.reasoning_parser = reasoning_parser

    def _reasoning_for(self, prompt_token_ids: list[int]) -> Any | None:
        if self.reasoning_parser is not None:
            return self.reasoning_parser()
        parser = self.chat.reasoning_parser
        return None if parser is None else PromptReasoning(parser, prompt_token_ids)

    def _stored(self, response_id: str, param: str | None = None) -> StoredResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(
                f"response {shorten(response_id)} is not stored on this server (never stored, deleted, or evicted "
                f"from the {self.store.capacity}-entry store)",
                404,
                param,
            )
        return entry

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        """Handle one request (errors raise APIError / ValueError, which the app renders as OpenAI errors)."""
        model = self.chat.models.check(req.model)
        lora = self.chat.models.lora_of(model)
        history = []
        if req.previous_response_id is not None:
            history = self._stored(req.previous_response_id, "previous_response_id").conversation
        chat_req, conversation = chat_request(req, history)
        try:
            plan, params, processed = await self.chat.prepare(chat_req, "max_output_tokens")
        except APIError as e:
            if e.param == "messages":  # what the client sent as input
                e.param = "input"
            raise
        response = initial_response(req, model)
        stream = await self.engine.add_request(response.id, processed, params, lora)
        reasoning_parser = self._reasoning_for(processed.prompt_token_ids)
        if req.stream:
            holdback = max((len(s) for s in params.stop), default=1) - 1
            events = self._stream(stream, response, plan, reasoning_parser, holdback, conversation)
            return EngineStreamingResponse(events)
        final = await run_unless_disconnected(raw, last_output(stream), stream.abort)
        finish(response, final, self.chat.reasoning_parser)
        response.output = output_items(final.outputs[0].text, plan, reasoning_parser, item_status(response))
        self._keep(response, conversation)
        return JSONResponse(response.model_dump())

    def _keep(self, response: ResponseObject, conversation: list[dict]) -> None:
        if response.store:
            self.store.put(StoredResponse(response, history_messages(conversation, response.output)))

    async def _stream(
        self,
        stream: RequestStream,
        response: ResponseObject,
        plan: ToolPlan,
        reasoning_parser: Any | None,
        holdback: int,
        conversation: list[dict],
    ) -> AsyncIterator[str]:
        write = EventWriter()
        items = OutputStreamer(write)
        tool_parser = plan.new_parser()
        tracker = DeltaTracker(holdback)
        raw_text, content_sent, reasoning_sent = "", 0, False
        last: RequestOutput | None = None
        try:
            yield write.lifecycle("response.created", response)
            yield write.lifecycle("response.in_progress", response)
            async for out in stream:
                last = out
                c = out.outputs[0]
                finished = c.finish_reason is not None
                text, _ = tracker.delta(0, c.text, None, finished)
                raw_text += text
                reasoning, content = split_reasoning(reasoning_parser, raw_text)
                if reasoning is not None and not reasoning_sent and (content or finished):
                    reasoning_sent = True
                    for event in items.reasoning(reasoning):
                        yield event
                if reasoning is not None and not reasoning_sent:
                    continue  # still reasoning: the item goes out whole once it ends
                for event in self._content_events(items, tool_parser, content, content_sent, finished):
                    yield event
                content_sent = len(content)
            if last is None:
                raise APIError("the request ended without output", 500)
            finish(response, last, self.chat.reasoning_parser)
            for event in items.finish(item_status(response)):
                yield event
            response.output = items.items
            self._keep(response, conversation)
            kind = "response.completed" if response.status == "completed" else "response.incomplete"
            yield write.lifecycle(kind, response)
        except Exception as e:  # noqa: BLE001 -- headers are out: report in-band
            err = to_api_error(e)
            response.status, response.output = "failed", items.items
            response.error = {
                "code": "server_error" if err.status >= 500 else "invalid_request",
                "message": err.message,
            }
            yield write.lifecycle("response.failed", response)
        finally:
            stream.abort()

    @staticmethod
    def _content_events(
        items: OutputStreamer, tool_parser: Any | None, content: str, sent: int, finished: bool
    ) -> list[str]:
        """The events for the content text so far (`sent` characters of it already went through)."""
        if tool_parser is None:
            return items.text(content[sent:]) if len(content) > sent else []
        delta = tool_parser.extract_tool_calls_streaming(content, finished)
        if delta is None:
            return []
        events = items.text(delta.content) if delta.content else []
        for call in delta.tool_calls or []:
            fn = call.function
            events += items.call(call.index, fn.name if fn else None, (fn.arguments if fn else None) or "")
        return events

    def retrieve(self, response_id: str) -> ResponseObject:
        """A stored Response (404 when not stored)."""
        return self._stored(response_id).response

    def delete(self, response_id: str) -> dict:
        """Forget a stored Response (404 when not stored)."""
        if not self.store.delete(response_id):
            self._stored(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def install_responses_routes(
    app: FastAPI,
    chat: OpenAIServingChat,
    store_size: int = DEFAULT_STORE_SIZE,
    reasoning_parser: Callable[[], Any] | None = None,
) -> OpenAIServingResponses:
    """Add POST /v1/responses, GET and DELETE /v1/responses/{response_id} to `app`."""
    serving = OpenAIServingResponses(chat, ResponseStore(store_size), reasoning_parser)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        return await serving.create(body, raw)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> JSONResponse:
        return JSONResponse(serving.retrieve(response_id).model_dump())

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONResponse:
        return JSONResponse(serving.delete(response_id))

    app.state.responses = serving
    return serving
