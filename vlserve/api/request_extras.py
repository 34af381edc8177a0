"""vLLM's request extras that shape the prompt or the response, as vLLM's OpenAI server reads them.

- `truncate_prompt_tokens` (both endpoints): the prompt's last k tokens run (-1: max_model_len); k over
  max_model_len is a 400 (InputProcessor.truncate_prompt).
- `cache_salt` (both): the salt enters the first KV block's prefix-cache hash (core/kv_cache_manager.py).
- `priority` (both): the request's place under `--scheduling-policy priority`; fcfs refuses a non-zero one.
- `return_token_ids` (both): chat responses carry `prompt_token_ids` and each choice `token_ids`; completion
  choices carry both; streamed, the prompt's ids come once (chat: the first chunk; completions: a choice's first
  chunk) and each chunk's `token_ids` holds the tokens new since that choice's last chunk.
- `echo`: completions put the prompt's text before each choice's text (streamed: in its first chunk); chat puts
  the last message's content before the reply when that message's role is the reply's role (the reply's role is
  "assistant", or with `add_generation_prompt: false` the last message's role), as vLLM does.
- `add_generation_prompt`, `continue_final_message` (not both) and `add_special_tokens` (chat): the chat template
  options (engine.input_processor.ChatTemplateOptions).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vlserve.api.errors import APIError
from vlserve.engine.input_processor import ChatTemplateOptions, ProcessedPrompt, check_cache_salt

# field -> its default: what beam search (vlserve.api.serving_beam) does not take
_NOT_WITH_BEAM_SEARCH = {
    "truncate_prompt_tokens": None,
    "priority": 0,
    "cache_salt": None,
    "return_token_ids": False,
    "echo": False,
    "add_generation_prompt": True,
    "continue_final_message": False,
    "add_special_tokens": False,
}


def check_beam_search_extras(req: Any) -> None:
    """APIError (400) naming the first extra a beam-search request sets (the beam search path does not apply
    them)."""
    for name, default in _NOT_WITH_BEAM_SEARCH.items():
        if getattr(req, name, default) != default:
            raise APIError(f"{name} is not supported with use_beam_search; leave it out", 400, name)


def chat_template_options(req: Any) -> ChatTemplateOptions:
    """The chat request's template options (ValueError for both add_generation_prompt and
    continue_final_message)."""
    return ChatTemplateOptions(req.add_generation_prompt, req.continue_final_message, req.add_special_tokens)


def with_prompt_extras(engine: Any, processed: ProcessedPrompt, req: Any) -> ProcessedPrompt:
    """The processed prompt truncated to `truncate_prompt_tokens` and carrying `cache_salt` (ValueError for a bad
    value of either); the engine truncates the same way, so the server's length checks see what runs."""
    processed = engine.input_processor.truncate_prompt(processed, req.truncate_prompt_tokens)
    return replace(processed, cache_salt=check_cache_salt(req.cache_salt))


def reply_role(req: Any) -> str:
    """The role of a chat reply: "assistant", or the last message's role with add_generation_prompt false."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def chat_echo_text(req: Any) -> str:
    """What `echo` puts before a chat reply: the last message's content (text parts joined by newlines) when its
    role is the reply's role; "" otherwise or without echo."""
    last = req.messages[-1]
    if not req.echo or last.role != reply_role(req) or not last.content:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.get("text", "") for part in last.content if part.get("type") == "text")


class TokenIdsDelta:
    """Streamed `return_token_ids`: per choice key, the token ids not yet sent (None when the field is off)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.sent: dict[Any, int] = {}

    def delta(self, key: Any, token_ids: list[int]) -> list[int] | None:
        if not self.enabled:
            return None
        start = self.sent.get(key, 0)
        self.sent[key] = len(token_ids)
        return list(token_ids[start:])
