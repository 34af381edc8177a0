"""Pydantic models of the OpenAI-compatible API: requests (validated) and responses (serialized)."""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from vlserve.api.request_fields import check_extra_fields
from vlserve.api.structured_request import structured_outputs_from_request
from vlserve.engine.request_limits import CHAT_ROLES, check_chat_template_kwargs
from vlserve.sampling_params import SamplingParams
from vlserve.shorten import shorten

_MAX_TOP_LOGPROBS = 20
MAX_N = 128  # OpenAI's cap on choices per request
_INT64 = (-(2**63), 2**63 - 1)


def random_id(prefix: str) -> str:
    """OpenAI-style object id, e.g. `chatcmpl-3f2a...`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def check_unicode(value: Any) -> Any:
    """ValueError when a string (or a string inside lists / dicts) holds a lone UTF-16 surrogate, which JSON escapes
    like "\\ud800" can carry but no tokenizer can take."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"text is not valid Unicode: {shorten(value[e.start : e.end])} at character {e.start} is a "
                f"lone UTF-16 surrogate"
            ) from None
    elif isinstance(value, dict):
        for item in value.values():
            check_unicode(item)
    elif isinstance(value, list):
        for item in value:
            check_unicode(item)
    return value


class OpenAIModel(BaseModel):
    """Base for request bodies: undeclared fields land in `model_extra` (vlserve.api.request_fields refuses the
    ones that would change the output and logs the unknown ones); NaN and infinite numbers are refused."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(BaseModel):
    """`stream_options`: whether the last chunk carries usage."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(OpenAIModel):
    """Fields shared by chat and completion requests."""

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # output constraints (vlserve.api.structured_request maps them onto SamplingParams.structured_outputs)
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structural_tag: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    # disaggregated prefill / decode (P2PConnector): {"do_remote_decode": true} on a producer, or the params a
    # producer returned on a consumer; the server refuses it without a KV connector (serving_base)
    kv_transfer_params: dict[str, Any] | None = None
    # logits adjustments (OpenAI's logit_bias: token id string -> bias in [-100, 100]; vLLM's allowed_token_ids and
    # bad_words) and vLLM's prompt_logprobs (top-k per prompt token; not with stream)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    # vLLM's prompt and response extras (vlserve.api.request_extras)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len)
    priority: int = 0  # --scheduling-policy priority: lower runs first
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    return_token_ids: bool = False  # prompt_token_ids and each choice's token_ids in the response

    _check_stop = field_validator("stop")(check_unicode)

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        endpoint: str,
        tool_schema: dict | None,
        structured_backend: str,
        thinking_token_budget: int | None = None,
    ) -> SamplingParams:
        """SamplingParams for this request (ValueError when a value is out of range or a field is unsupported)."""
        check_extra_fields(self.model_extra, endpoint)
        structured = structured_outputs_from_request(self, tool_schema, structured_backend)
        if self.n > MAX_N:
            raise ValueError(f"n must be <= {MAX_N}, got {self.n}")
        if self.seed is not None and not _INT64[0] <= self.seed <= _INT64[1] - MAX_N:
            raise ValueError(f"seed must fit in a signed 64-bit integer (and leave room for n), got {self.seed}")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream=true")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=structured,
            kv_transfer_params=self.kv_transfer_params,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            prompt_logprobs=self.prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            thinking_token_budget=thinking_token_budget,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(OpenAIModel):
    """One message; content is a string or a list of content parts (text, image_url, video_url, input_audio).
    Assistant messages may carry `tool_calls` (content may then be null); tool messages answer one by
    `tool_call_id` (vlserve.engine.chat checks both)."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise ValueError(f"role must be one of {', '.join(CHAT_ROLES)}; got {shorten(role)}")
        return role

    _check_content = field_validator("content")(check_unicode)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None  # checked by vlserve.api.media_controls
    video_pruning_rate: float | None = None  # over --video-pruning-rate (vlserve.multimodal.video_pruning)
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    tools: Any = None  # checked by vlserve.api.tool_choice
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extras (vlserve.api.request_extras)
    echo: bool = False  # the last message's content before the reply, when its role is the reply's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    # reasoning (--reasoning-parser): whether the reply carries it (it is split off the content either way), and
    # the most tokens the model may reason before the engine ends the reasoning (a 400 without a parser)
    include_reasoning: bool = True
    thinking_token_budget: int | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens_positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:  # checked here so the error names the field the client sent
            raise ValueError(f"max_completion_tokens must be an integer >= 1, got {value}")
        return value

    def check_supported(self) -> None:
        """ValueError for logprob settings this server does not take."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= _MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {_MAX_TOP_LOGPROBS}], got {self.top_logprobs}")

    def template_kwargs(self, trust_request_template: bool) -> dict[str, Any]:
        """The kwargs for apply_chat_template; a request-supplied template only when the server trusts them."""
        if self.chat_template is not None and not trust_request_template:
            raise ValueError(
                "chat_template: request-supplied chat templates are refused; start the server with "
                "--trust-request-chat-template to allow them"
            )
        kwargs = check_chat_template_kwargs(self.chat_template_kwargs, trust_request_template)
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        return kwargs

    def to_sampling_params(
        self, *, tool_schema: dict | None = None, structured_backend: str = "xgrammar"
    ) -> SamplingParams:
        """max_completion_tokens wins over the deprecated max_tokens; logprobs=true -> top_logprobs (default 0).
        `tool_schema`: the JSON schema a tool_choice imposes (vlserve.api.tool_choice.ToolPlan.constraint);
        `structured_backend`: the server's grammar backend (what guided_decoding_backend may name)."""
        self.check_supported()
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.max_completion_tokens is not None and self.min_tokens > self.max_completion_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_completion_tokens ({self.max_completion_tokens})."
            )
        return self._sampling_params(
            max_tokens,
            (self.top_logprobs or 0) if self.logprobs else None,
            "chat",
            tool_schema,
            structured_backend,
            self.thinking_token_budget,
        )

    def messages_as_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=False) for m in self.messages]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions (prompt: a string, a list of strings, token ids, or a list of token-id lists)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    media_io_kwargs: dict[str, Any] | None = None  # checked by vlserve.api.media_controls (no media here)

    _check_prompt = field_validator("prompt")(check_unicode)

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, one entry each (ValueError when empty)."""
        p = self.prompt
        if isinstance(p, str):
            out: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            out = [list(p)]
        else:
            out = list(p)
        if not out:
            raise ValueError("prompt must not be empty")
        return out

    def to_sampling_params(self, *, structured_backend: str = "xgrammar") -> SamplingParams:
        """SamplingParams of each prompt (ValueError for unsupported fields and bad values)."""
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported by this server (it needs the prompt's logprobs)")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.logprobs is not None and not 0 <= self.logprobs <= _MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {_MAX_TOP_LOGPROBS}], got {self.logprobs}")
        return self._sampling_params(self.max_tokens, self.logprobs, "completion", None, structured_backend)


# -- responses ----------------------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts; `prompt_tokens_details.cached_tokens` counts prompt tokens served from the prefix cache,
    `completion_tokens_details.reasoning_tokens` (with a reasoning parser) the output tokens inside the reasoning."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class _OmitNone(BaseModel):
    """Serializes without the fields named in `omit_if_none` while they are None (OpenAI leaves them out)."""

    omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_nones(self, handler):
        data = handler(self)
        for name in self.omit_if_none:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    """One tool call of an assistant message."""

    id: str = Field(default_factory=lambda: ToolCall.new_id())
    type: Literal["function"] = "function"
    function: FunctionCall

    @staticmethod
    def new_id() -> str:
        return random_id("chatcmpl-tool")


class DeltaFunctionCall(_OmitNone):
    omit_if_none: ClassVar[tuple[str, ...]] = ("name", "arguments")
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OmitNone):
    """A streamed piece of tool call `index`: id, type and name come once, then argument fragments."""

    omit_if_none: ClassVar[tuple[str, ...]] = ("id", "type")
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(_OmitNone):
    """`reasoning` and its older name `reasoning_content` (same value) come with a reasoning parser."""

    omit_if_none: ClassVar[tuple[str, ...]] = ("tool_calls", "reasoning", "reasoning_content")
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_OmitNone):
    omit_if_none: ClassVar[tuple[str, ...]] = ("token_ids",)
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(_OmitNone):
    """Non-streamed chat completion."""

    omit_if_none: ClassVar[tuple[str, ...]] = ("prompt_token_ids",)

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None  # a P2P producer's: where a consumer reads the prompt's KV
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None  # when the request asked for them
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaMessage(_OmitNone):
    omit_if_none: ClassVar[tuple[str, ...]] = ("tool_calls", "reasoning", "reasoning_content")
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_OmitNone):
    omit_if_none: ClassVar[tuple[str, ...]] = ("token_ids",)
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the tokens new since the choice's last chunk


class ChatCompletionChunk(_OmitNone):
    """One SSE event of a streamed chat completion."""

    omit_if_none: ClassVar[tuple[str, ...]] = ("prompt_token_ids",)

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the first chunk


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token of a position's `prompt_logprobs` entry (vLLM's shape)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(_OmitNone):
    omit_if_none: ClassVar[tuple[str, ...]] = ("prompt_logprobs", "prompt_token_ids", "token_ids")
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None  # when the request asked for them
    # return_token_ids (streamed: the prompt's on a choice's first chunk, then the tokens new since its last one)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """A completion, or one SSE event of a streamed one (`object` says which)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a P2P producer's (non-streamed responses only)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vlserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None
    tasks: list[str] | None = None  # what the server serves: ["generate"] or the pooling tasks (serving_pooling)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
