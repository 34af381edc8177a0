"""The one place a reasoning item is read out of the model's text (`--reasoning-parser`).

`split_reasoning(parser, text)` is called on the whole output (non-streamed) and on the text so far (streamed);
with `parser` None the text is all content. A parser with `extract(text) -> (reasoning | None, content | None)`
plugs in here; the serving side emits a `reasoning` output item ahead of the message when reasoning comes back.
`PromptReasoning` gives the server's own parser (`--reasoning-parser`) that shape for one request.
"""

from __future__ import annotations

from typing import Any


def split_reasoning(parser: Any | None, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of `text`; all content when there is no reasoning parser."""
    if parser is None:
        return None, text
    reasoning, content = parser.extract(text)
    return reasoning, content or ""


class PromptReasoning:
    """The server's reasoning parser bound to one request's prompt token ids (the prompt's last think tag says where
    the output begins): `extract(text)` as `split_reasoning` takes it."""

    def __init__(self, parser: Any, prompt_token_ids: list[int]) -> None:
        self.parser = parser
        self.prompt_token_ids = prompt_token_ids

    def extract(self, text: str) -> tuple[str | None, str | None]:
        return self.parser.extract(text, self.prompt_token_ids)
