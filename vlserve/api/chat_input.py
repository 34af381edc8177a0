"""The chat completion request behind endpoints that render chat `messages` without generating (/tokenize, the
pooling endpoints), so their input side is the chat endpoint's."""

from __future__ import annotations

from typing import Any

from vlserve.api.protocol import ChatCompletionRequest


def chat_input_request(fields: Any) -> ChatCompletionRequest:
    """The chat completion request whose input side renders `fields.messages` (a /tokenize or pooling request's
    model, messages, chat template, its kwargs and the processor kwargs)."""
    return ChatCompletionRequest(
        model=fields.model,
        messages=fields.messages,
        chat_template=fields.chat_template,
        chat_template_kwargs=fields.chat_template_kwargs,
        mm_processor_kwargs=fields.mm_processor_kwargs,
    )
