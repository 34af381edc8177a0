"""No request field silently dropped: the fields a request may carry beyond the ones this server implements.

- A field vLLM (or OpenAI) accepts that would change the output here, sent with a value other than its no-op
  default, is a 400 naming it (the table below: field -> the values that change nothing).
- Fields that change no output (bookkeeping: metadata, store, request_id, ...) are accepted quietly.
- A field neither vLLM nor OpenAI knows is accepted and ignored with one warning in the log per field name.
"""

from __future__ import annotations

import logging
from typing import Any

from vlserve.shorten import shorten

logger = logging.getLogger(__name__)

_NONE = (None,)
_FALSE = (None, False)
_EMPTY = (None, [], {})

# Both endpoints (vLLM's sampling and extra parameters, OpenAI's fields vLLM lacks), field -> no-op values.
_UNSUPPORTED_COMMON: dict[str, tuple] = {
    "best_of": (None, 1),
    "use_beam_search": _FALSE,
    "length_penalty": (None, 1, 1.0),
    "early_stopping": _FALSE,
    "spaces_between_special_tokens": (None, True),
    "logits_processors": _EMPTY,
    "return_tokens_as_token_ids": _FALSE,
    "vllm_xargs": _EMPTY,
    "prompt_embeds": _NONE,
    "thinking_token_budget": _NONE,
}
_UNSUPPORTED_CHAT: dict[str, tuple] = {
    **_UNSUPPORTED_COMMON,
    "documents": _EMPTY,
    "reasoning_effort": _NONE,
    # OpenAI's: the legacy function-calling fields (use tools / tool_choice), audio output, predicted outputs
    "functions": _EMPTY,
    "function_call": (None, "none"),
    "audio": _NONE,
    "modalities": (None, ["text"]),
    "prediction": _NONE,
    "web_search_options": _NONE,
}
_UNSUPPORTED_COMPLETION: dict[str, tuple] = {
    **_UNSUPPORTED_COMMON,
    "add_special_tokens": (None, True),
    "include_reasoning": (None, True),  # completions return the text whole (chat splits reasoning off)
}
# POST /v1/responses (vlserve.api.responses): OpenAI's Responses fields this server lacks, and the chat sampling
# fields vLLM's Responses endpoint takes but this one does not
_UNSUPPORTED_RESPONSES: dict[str, tuple] = {
    **_UNSUPPORTED_COMMON,
    "background": _FALSE,
    "conversation": _NONE,
    "include": _EMPTY,
    "max_tool_calls": _NONE,
    "prompt": _NONE,
    "reasoning": _EMPTY,
    "truncation": (None, "disabled"),
    "top_logprobs": (None, 0),
    "n": (None, 1),
    "stop": _EMPTY,
    "top_k": (None, -1, 0),
    "min_p": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "chat_template_kwargs": _EMPTY,
    "chat_template": _NONE,
}
_TABLES = {"chat": _UNSUPPORTED_CHAT, "completion": _UNSUPPORTED_COMPLETION, "responses": _UNSUPPORTED_RESPONSES}

# Known fields that change nothing a response carries (ids, bookkeeping, options of parts we do not have).
_NO_EFFECT = frozenset(
    {
        "request_id",
        "store",
        "metadata",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "verbosity",
        "stream_options",
    }
)

# Refused above unless the request runs beam search, which takes them (vlserve.api.serving_beam).
BEAM_SEARCH_FIELDS = frozenset({"use_beam_search", "length_penalty", "early_stopping"})
_BEAM_ONLY = BEAM_SEARCH_FIELDS - {"use_beam_search"}
_BEAM_ONLY_HINT = " (it applies to beam search only: send use_beam_search=true with it)"

_MAX_WARNED = 1024  # field names remembered for the once-per-name warning (a client may invent many)
_warned: set[str] = set()


def _is_noop(value: Any, noops: tuple) -> bool:
    return any(value == v for v in noops)


def check_extra_fields(extra: dict[str, Any] | None, endpoint: str) -> None:
    """ValueError naming the first field that this server does not implement and that would change the output;
    one log warning per other unknown field name. `endpoint`: "chat", "completion" or "responses"."""
    table = _TABLES[endpoint]
    for name, value in (extra or {}).items():
        noops = table.get(name)
        if noops is not None:
            if not _is_noop(value, noops):
                raise ValueError(
                    f"{name} is not supported by this server (it would change the output); leave it "
                    f"out{_default_hint(noops)}{_BEAM_ONLY_HINT if name in _BEAM_ONLY else ''}"
                )
        elif name not in _NO_EFFECT:
            _warn_once(name)


def _default_hint(noops: tuple) -> str:
    shown = [v for v in noops if v is not None]
    return f" or send {shorten(shown[0])}" if shown else ""


def _warn_once(name: str) -> None:
    if name in _warned:
        return
    if len(_warned) < _MAX_WARNED:
        _warned.add(name)
        logger.warning("request field %s is not one this server knows; it was ignored", shorten(name))
