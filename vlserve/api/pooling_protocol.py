"""Request bodies of the pooling endpoints (vLLM's and OpenAI's shapes): POST /v1/embeddings, /pooling, /v1/score
and /v1/rerank. Every body refuses a field it does not declare (a 400 naming it); score and rerank inputs are
checked by `vlserve.engine.scoring.score_inputs`, which names the field in its errors."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vlserve.api.chat_input import chat_input_request
from vlserve.api.protocol import ChatCompletionRequest, ChatMessage, check_unicode


class _StrictModel(BaseModel):
    """A field this endpoint does not know is a 400 naming it (nothing ignored silently); NaN/inf refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _PoolingFields(_StrictModel):
    """Fields every pooling request takes: the model, OpenAI's `user` (bookkeeping only), vLLM's
    `truncate_prompt_tokens` (keep each prompt's last k tokens; -1: max_model_len) and `priority`."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = 0


class _InputFields(_PoolingFields):
    """`input` (a string, strings, token ids or lists of token ids) or chat `messages` (one prompt, rendered by
    the chat template as the chat endpoint renders them; `add_generation_prompt` off by default, as vLLM's)."""

    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for input, false for messages
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None

    _check_input = field_validator("input")(check_unicode)

    @model_validator(mode="after")
    def _one_source(self):
        if (self.input is None) == (self.messages is None):
            raise ValueError("give either input or messages (exactly one)")
        if self.messages is None:
            chat_only = ("chat_template", "chat_template_kwargs", "mm_processor_kwargs")
            sent = [n for n in chat_only if getattr(self, n) is not None]
            sent += [n for n in ("add_generation_prompt", "continue_final_message") if getattr(self, n)]
            if sent:
                raise ValueError(f"{', '.join(sent)} apply to messages only")
        return self

    def inputs(self) -> list[str | list[int]]:
        """The prompts of `input`, one entry each (ValueError when empty)."""
        value = self.input
        if isinstance(value, str):
            items: list = [value]
        elif value and all(isinstance(x, int) for x in value):
            items = [list(value)]
        else:
            items = list(value or [])
        if not items or any(len(x) == 0 for x in items):
            raise ValueError("input must not be empty (nor hold an empty string or token list)")
        return items

    def as_chat_request(self) -> ChatCompletionRequest:
        """The chat completion request whose input processing renders `messages`."""
        return chat_input_request(self)


class EmbeddingRequest(_InputFields):
    """POST /v1/embeddings: OpenAI's fields (`input`, `encoding_format`, `dimensions`, `user`) plus vLLM's
    (`messages`, `normalize`, `truncate_prompt_tokens`, `priority`, `add_special_tokens`, chat options)."""


class PoolingRequest(_InputFields):
    """POST /pooling: the raw pooled output for `task` (default "encode"); `use_activation` for classify / score."""

    task: Literal["embed", "classify", "score", "encode"] | None = None
    use_activation: bool | None = None


class _ScoreFields(_PoolingFields):
    mm_processor_kwargs: dict[str, Any] | None = None
    use_activation: bool | None = None  # a classifier's sigmoid / softmax (default on)


class ScoreRequest(_ScoreFields):
    """POST /v1/score: two sides, named `text_1` / `text_2`, `queries` / `documents` or `data_1` / `data_2`
    (vLLM's names); each a string, a list, or `{"content": [parts]}` (vlserve.engine.scoring)."""

    text_1: Any = None
    text_2: Any = None
    queries: Any = None
    documents: Any = None
    data_1: Any = None
    data_2: Any = None

    @model_validator(mode="after")
    def _one_pair(self):
        given = [
            pair for pair in self.PAIRS if getattr(self, pair[0]) is not None or getattr(self, pair[1]) is not None
        ]
        if len(given) != 1:
            names = " or ".join(f"{a} / {b}" for a, b in self.PAIRS)
            raise ValueError(f"give exactly one pair of sides: {names}")
        for name in given[0]:
            if getattr(self, name) is None:
                raise ValueError(f"{name} is missing")
        return self

    _check_sides = field_validator("text_1", "text_2", "queries", "documents", "data_1", "data_2")(check_unicode)

    PAIRS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("text_1", "text_2"),
        ("queries", "documents"),
        ("data_1", "data_2"),
    )

    def sides(self) -> tuple[tuple[str, str], Any, Any]:
        """((the two field names), the queries, the documents)."""
        for a, b in self.PAIRS:
            if getattr(self, a) is not None:
                return (a, b), getattr(self, a), getattr(self, b)
        raise ValueError("no sides")  # unreachable after validation


class RerankRequest(_ScoreFields):
    """POST /v1/rerank (also /rerank, /v2/rerank): `query` against `documents`, the `top_n` best (0: all), with
    each result's document unless `return_documents` is false."""

    query: Any
    documents: Any
    top_n: int = Field(default=0, ge=0)
    return_documents: bool = True

    _check_sides = field_validator("query", "documents")(check_unicode)
