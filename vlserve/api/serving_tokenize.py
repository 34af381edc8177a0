"""POST /tokenize and POST /detokenize (vLLM's shapes).

/tokenize takes either a `prompt` (text; `add_special_tokens` default true) or chat `messages` (`add_generation_prompt`
default true, `add_special_tokens` default false, `chat_template`, `chat_template_kwargs`, `mm_processor_kwargs`,
`tools`) and answers `{count, max_model_len, tokens, token_strs}`; `token_strs` (the tokenizer's token strings) only
with `return_token_strs`. Messages go through the chat endpoint's own input processing (media fetched, template
rendered, each image's placeholder run expanded), so `count` is the `prompt_tokens` a chat request with the same
messages reports. /detokenize takes `tokens` and answers `{prompt}`. Like vLLM's, both routes sit outside /v1.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from vlserve.api.chat_input import chat_input_request
from vlserve.api.errors import APIError
from vlserve.api.protocol import ChatCompletionRequest, ChatMessage, check_unicode
from vlserve.api.serving_base import ServedModels
from vlserve.api.serving_chat import OpenAIServingChat
from vlserve.api.tool_choice import validate_tools
from vlserve.engine.input_processor import ChatTemplateOptions
from vlserve.engine.request_limits import check_prompt_chars


class _StrictModel(BaseModel):
    """A field this route does not know is a 400 naming it (nothing ignored silently); NaN/inf refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TokenizeCompletionRequest(_StrictModel):
    """/tokenize with a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False

    _check_prompt = field_validator("prompt")(check_unicode)


class TokenizeChatRequest(_StrictModel):
    """/tokenize with chat messages (rendered as a chat completion request renders them)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: Any = None

    def as_chat_request(self) -> ChatCompletionRequest:
        """The chat completion request whose input processing this tokenization is."""
        if self.continue_final_message:
            raise APIError(
                "continue_final_message is not supported by this server; leave it out or send false",
                400,
                "continue_final_message",
            )
        return chat_input_request(self)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_StrictModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


async def _json_object(raw: Request) -> dict[str, Any]:
    """The request body as a JSON object (400 otherwise)."""
    try:
        data = json.loads(await raw.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"invalid JSON body: {e}", 400) from None
    if not isinstance(data, dict):
        raise APIError(f"the body must be a JSON object, got {type(data).__name__}", 400)
    return data


def _validate(model_cls: type[BaseModel], data: dict[str, Any]) -> Any:
    """`model_cls` from `data`; a validation failure is the app's usual 400 naming the field."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


class OpenAIServingTokenization:
    """Tokenizes prompts and chat messages as the generation endpoints do, and decodes token ids back to text."""

    def __init__(self, chat: OpenAIServingChat, models: ServedModels):
        self.chat = chat
        self.engine = chat.engine
        self.models = models
        self.tokenizer = chat.engine.tokenizer

    async def tokenize(self, data: dict[str, Any]) -> TokenizeResponse:
        """`data`: a TokenizeCompletionRequest or TokenizeChatRequest body (which one: `prompt` or `messages`)."""
        if "prompt" in data and "messages" in data:
            raise APIError("give either prompt or messages, not both", 400, "messages")
        if "messages" in data:
            req = _validate(TokenizeChatRequest, data)
            self.models.check(req.model)
            tools = validate_tools(req.tools) or None
            processed = await self.chat._process(
                req.as_chat_request(),
                tools,
                ChatTemplateOptions(
                    add_generation_prompt=req.add_generation_prompt, add_special_tokens=req.add_special_tokens
                ),
            )
            token_ids = list(processed.prompt_token_ids)
        else:
            req = _validate(TokenizeCompletionRequest, data)
            self.models.check(req.model)
            processor = self.engine.input_processor
            check_prompt_chars(req.prompt, processor.max_prompt_chars, self.engine.max_model_len)
            encoded = await asyncio.to_thread(self.tokenizer, req.prompt, add_special_tokens=req.add_special_tokens)
            token_ids = list(encoded["input_ids"])
        token_strs = self.tokenizer.convert_ids_to_tokens(token_ids) if req.return_token_strs else None
        return TokenizeResponse(
            count=len(token_ids), max_model_len=self.engine.max_model_len, tokens=token_ids, token_strs=token_strs
        )

    async def detokenize(self, data: dict[str, Any]) -> DetokenizeResponse:
        """The text of `tokens` (special tokens kept, as vLLM decodes them); 400 for an id the tokenizer lacks."""
        req = _validate(DetokenizeRequest, data)
        self.models.check(req.model)
        size = len(self.tokenizer)
        unknown = next((t for t in req.tokens if not 0 <= t < size), None)
        if unknown is not None:
            raise APIError(f"token id {unknown} is out of vocabulary (ids are 0..{size - 1})", 400, "tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(self.tokenizer.decode, req.tokens))


def install_tokenize_routes(app: FastAPI, chat: OpenAIServingChat, models: ServedModels) -> None:
    """POST /tokenize and POST /detokenize, reusing the chat endpoint's input processing."""
    serving = OpenAIServingTokenization(chat, models)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> JSONResponse:
        return JSONResponse((await serving.tokenize(await _json_object(raw))).model_dump())

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> JSONResponse:
        return JSONResponse((await serving.detokenize(await _json_object(raw))).model_dump())
