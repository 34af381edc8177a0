"""The one place a reasoning item is read out of the model's text (`--reasoning-parser`).

`split_reasoning(parser, text)` is called on the whole output (non-streamed) and on the text so far (streamed);
with `parser` None the text is all content. A parser with `extract(text) -> (reasoning | None, content | None)`
plugs in here; the serving side emits a `reasoning` output item ahead of the message when reasoning comes back.
"""

from __future__ import annotations

from typing import Any


def split_reasoning(parser: Any | None, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of `text`; all content when there is no reasoning parser."""
    if parser is None:
        return None, text
    reasoning, content = parser.extract(text)
    return reasoning, content or ""
