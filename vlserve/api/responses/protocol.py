"""Pydantic models of POST /v1/responses: the request (validated; fields this server lacks refused as in
vlserve.api.request_fields) and the Response object with its output items and usage."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from vlserve.api.protocol import OpenAIModel, check_unicode
from vlserve.api.request_fields import check_extra_fields


def object_id(prefix: str) -> str:
    """An id in OpenAI's Responses form, e.g. `resp_3f2a...`, `msg_...`, `fc_...`, `call_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses. `input`: a string (one user message) or a list of input items (messages,
    function_call, function_call_output, reasoning); vlserve.api.responses.convert turns it into chat messages."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's per-request media settings, passed to the chat endpoint's input side as they are
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None

    _check_text = field_validator("input", "instructions")(check_unicode)

    @field_validator("max_output_tokens")
    @classmethod
    def _max_output_tokens_positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"max_output_tokens must be an integer >= 1, got {value}")
        return value

    def check_fields(self) -> None:
        """ValueError naming a field this server does not implement that would change the output."""
        check_extra_fields(self.model_extra, "responses")


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """Token counts; `input_tokens_details.cached_tokens` counts prompt tokens served from the prefix cache."""

    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class MessageItem(BaseModel):
    """An assistant message of the output (one output_text part)."""

    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: object_id("msg"))
    role: Literal["assistant"] = "assistant"
    status: str = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    """A call the model makes to one of the request's function tools; answer it with a function_call_output item
    carrying the same `call_id`."""

    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: object_id("fc"))
    call_id: str = Field(default_factory=lambda: object_id("call"))
    name: str
    arguments: str = ""
    status: str = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """The model's reasoning, when the server reads it out of the text (vlserve.api.responses.reasoning)."""

    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: object_id("rs"))
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: str = "completed"


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class ResponseObject(BaseModel):
    """A Response: what POST /v1/responses returns, GET /v1/responses/{id} gives back, and streamed lifecycle
    events carry."""

    id: str = Field(default_factory=lambda: object_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: str = "in_progress"  # in_progress | completed | incomplete | failed
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    truncation: str = "disabled"
    background: bool = False
    user: str | None = None

    @property
    def output_text(self) -> str:
        """The text of every output_text part, joined."""
        return "".join(p.text for item in self.output if isinstance(item, MessageItem) for p in item.content)
