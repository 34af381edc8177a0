"""Cheap checks on untrusted request input, done before the expensive work (templating, tokenizing, media):
chat-template kwargs, message roles, prompt length in characters, and max_tokens against the context left."""

from __future__ import annotations

from typing import Any

from vlserve.shorten import shorten

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")

# apply_chat_template's own parameters: the server sets them, a request may not.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)

# NFC/NFKC normalizers may compose up to 4 code points into one, so a normalized prompt can be that much shorter.
_NORMALIZER_SLACK = 4


def is_template_key(key: str) -> bool:
    """Keys that would carry a Jinja template (`chat_template`, or anything naming a template)."""
    return "template" in key.lower()


def check_chat_template_kwargs(
    kwargs: dict[str, Any] | None, allow_template: bool, field: str = "chat_template_kwargs"
) -> dict[str, Any]:
    """The kwargs to pass to apply_chat_template (ValueError naming the key and the rule otherwise).

    Template-carrying keys are refused unless `allow_template` (the server's --trust-request-chat-template);
    apply_chat_template's own parameters (tokenize, tools, ...) are always refused.
    """
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"{field} must be an object, got {type(kwargs).__name__}")
    for key in kwargs:
        if not isinstance(key, str):
            raise ValueError(f"{field} keys must be strings, got {shorten(key)}")
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise ValueError(
                f"{field}[{shorten(key)}] is not allowed: the server sets that parameter of the chat template itself"
            )
        if is_template_key(key) and not allow_template:
            raise ValueError(
                f"{field}[{shorten(key)}]: request-supplied chat templates are refused; start the "
                f"server with --trust-request-chat-template to allow them"
            )
    return dict(kwargs)


def check_role(role: Any, where: str) -> None:
    """ValueError unless `role` is one of CHAT_ROLES."""
    if role not in CHAT_ROLES:
        raise ValueError(f"{where}: role must be one of {', '.join(CHAT_ROLES)}; got {shorten(role)}")


def longest_token_chars(tokenizer: Any) -> int:
    """Length in characters of the longest token string in the vocab (added tokens included)."""
    vocab = tokenizer.get_vocab()
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    lengths = [len(t) for t in vocab] + [len(str(getattr(t, "content", t))) for t in added.values()]
    return max(lengths, default=1) or 1


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """A prompt of more characters cannot fit in `max_model_len` tokens, so it can be refused untokenized.

    Every token covers at most `longest_token_chars` characters of (normalized) text, hence a prompt of C characters
    has at least C / that many tokens; a normalizer (NFC/NFKC) may shorten the text, which the slack covers.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    slack = _NORMALIZER_SLACK if backend is None or backend.normalizer is not None else 1
    return max_model_len * longest_token_chars(tokenizer) * slack


def check_prompt_chars(text: str, limit: int, max_model_len: int) -> None:
    """ValueError for a prompt too long to fit even before tokenizing, and for text that is not valid Unicode."""
    if len(text) > limit:
        raise ValueError(
            f"the prompt has {len(text)} characters, more than can fit in max_model_len="
            f"{max_model_len} tokens (at most {limit} characters); shorten the prompt"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"the prompt is not valid Unicode: {shorten(text[e.start : e.end])} at character {e.start} "
            f"is a lone UTF-16 surrogate"
        ) from None


def check_max_tokens_fit(
    max_tokens: int | None, prompt_tokens: int, max_model_len: int, field: str = "max_tokens"
) -> None:
    """ValueError when the prompt plus `max_tokens` exceed the model's context (None means "whatever is left").
    A prompt that alone fills the context is left to the engine's own check, which says so. `field`: the name the
    client gave the limit (max_tokens or max_completion_tokens), which the message uses."""
    if max_tokens is None or prompt_tokens >= max_model_len or prompt_tokens + max_tokens <= max_model_len:
        return
    room = max_model_len - prompt_tokens
    raise ValueError(
        f"{field} is too large: this model's context (max_model_len) holds {max_model_len} tokens, the prompt uses "
        f"{prompt_tokens}, and {max_tokens} were requested for the completion "
        f"({prompt_tokens + max_tokens} in all); ask for at most {max(room, 0)} completion tokens or "
        f"shorten the prompt"
    )
