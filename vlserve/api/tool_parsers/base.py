"""The tool-parser interface and its registry (what --tool-call-parser names).

A parser reads tool calls out of the model's text. Subclasses implement only `parse(text, finished)`, a pure function
of the text so far; the non-streaming result and the streamed deltas both come from it, so streamed fragments
concatenate to the non-streamed calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vlserve.api.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall
from vlserve.shorten import shorten


@dataclass
class ParsedCall:
    """One tool call in the text so far: `name` once it is complete, `arguments` the raw JSON text written so far."""

    name: str | None
    arguments: str


class ToolParser:
    """Reads tool calls out of generated text. Make one per choice: the streaming method remembers what it sent.
    `max_calls` keeps only the first calls (1 for parallel_tool_calls=false)."""

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls
        self._content_sent = 0
        self._arguments_sent: list[int] = []

    def parse(self, text: str, finished: bool) -> tuple[str, list[ParsedCall]]:
        """(content, calls) of `text`. With finished=False, hold back whatever more text could still change: the
        content, each name and each call's arguments returned must be prefixes of what the finished text gives."""
        raise NotImplementedError

    def _calls(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        return calls if self.max_calls is None else calls[: self.max_calls]

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished output; content is None when only tool calls remain."""
        content, calls = self.parse(text, finished=True)
        found = self._calls([c for c in calls if c.name is not None])
        if not found:
            return content, []
        return content or None, [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in found]

    def extract_tool_calls_streaming(self, text: str, finished: bool = False) -> DeltaMessage | None:
        """What is new in the cumulative `text` since the last call: content, and per call its index with id, type
        and name once, then fragments of its arguments. None when nothing is new."""
        content, calls = self.parse(text, finished)
        new_content = content[self._content_sent :]
        self._content_sent = max(self._content_sent, len(content))
        deltas: list[DeltaToolCall] = []
        for index, call in enumerate(self._calls(calls)):
            if call.name is None:
                break
            if index == len(self._arguments_sent):
                self._arguments_sent.append(len(call.arguments))
                deltas.append(
                    DeltaToolCall(
                        index=index,
                        id=ToolCall.new_id(),
                        type="function",
                        function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
                    )
                )
            elif len(call.arguments) > self._arguments_sent[index]:
                fragment = call.arguments[self._arguments_sent[index] :]
                self._arguments_sent[index] = len(call.arguments)
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment)))
        if not new_content and not deltas:
            return None
        return DeltaMessage(content=new_content or None, tool_calls=deltas or None)

    @property
    def streamed_calls(self) -> int:
        """How many tool calls the streaming method has started."""
        return len(self._arguments_sent)


class ToolParserManager:
    """Tool parsers by name: `register(name)` decorates a ToolParser subclass, `get(name)` looks one up."""

    _parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register(cls, name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
        """Class decorator: make the parser available as --tool-call-parser `name`."""

        def add(parser: type[ToolParser]) -> type[ToolParser]:
            if not (isinstance(parser, type) and issubclass(parser, ToolParser)):
                raise TypeError(f"{parser!r} is not a ToolParser subclass")
            cls._parsers[name] = parser
            return parser

        return add

    @classmethod
    def get(cls, name: str) -> type[ToolParser]:
        """The parser registered as `name` (ValueError naming the known ones otherwise)."""
        parser = cls._parsers.get(name)
        if parser is None:
            raise ValueError(f"unknown tool call parser {shorten(name)}; known: {', '.join(cls.names()) or 'none'}")
        return parser

    @classmethod
    def names(cls) -> list[str]:
        """The registered names, sorted."""
        return sorted(cls._parsers)
