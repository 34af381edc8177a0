"""Hermes-style tool calls, as Qwen2.5(-VL)'s chat template asks for them:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each block holding a JSON object with a string `name` and an object `arguments` (may be left out: "{}") is a call;
`arguments` keeps the model's own JSON text. A block that is not such JSON stays in the content, tags included.
The content is the text outside the calls, with the whitespace that touches a call removed; an unclosed last
block counts when the output ends with valid JSON in it (a stop string may cut the closing tag).
"""

from __future__ import annotations

import json

from vlserve.api.tool_parsers.base import ParsedCall, ToolParser, ToolParserManager
from vlserve.api.tool_parsers.partial_json import raw_value, scan_object, skip_ws, string_value

_CALL, _OPEN = "call", "open"


def _held_tag_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may still become the tag)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


@ToolParserManager.register("hermes")
class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5, Qwen2.5-VL)."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self._closed: dict[str, ParsedCall | None] = {}  # closed blocks by body: streaming reads them again

    def parse(self, text: str, finished: bool) -> tuple[str, list[ParsedCall]]:
        segments: list[str] = [""]  # content between boundaries
        boundaries: list[str] = []  # _CALL or _OPEN after each segment but the last
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            start = text.find(self.start_tag, pos)
            if start < 0:
                segments[-1] += text[pos:]
                break
            segments[-1] += text[pos:start]
            body_start = start + len(self.start_tag)
            end = text.find(self.end_tag, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            if end >= 0:
                if body not in self._closed:
                    self._closed[body] = self._finished_call(body)
                call = self._closed[body]
            elif finished:
                call = self._finished_call(body)
            else:
                try:
                    call = self._open_call(body)
                except ValueError:  # cannot become a call: it is content already
                    segments[-1] += text[start:]
                    break
            if call is None and (end >= 0 or finished):
                segments[-1] += text[start:] if end < 0 else text[start : end + len(self.end_tag)]
            else:
                if call is not None:
                    calls.append(call)
                boundaries.append(_CALL if end >= 0 or finished else _OPEN)
                segments.append("")
            if end < 0:
                break
            pos = end + len(self.end_tag)
        return self._content(segments, boundaries, finished), calls

    def _content(self, segments: list[str], boundaries: list[str], finished: bool) -> str:
        out = []
        for k, segment in enumerate(segments):
            if k > 0 and boundaries[k - 1] == _CALL:
                segment = segment.lstrip()
            if k < len(boundaries):
                segment = segment.rstrip()
            elif not finished:  # the tail may still open a block: hold back what could be its tag and spacing
                segment = segment[: len(segment) - _held_tag_prefix(segment, self.start_tag)].rstrip()
            out.append(segment)
        return "".join(out)

    @staticmethod
    def _finished_call(body: str) -> ParsedCall | None:
        """The call a complete block holds, or None when it is not one."""
        try:
            json.loads(body)
            fields, _ = scan_object(body, skip_ws(body, 0))
            name = string_value(body, fields.get("name"))
        except ValueError:
            return None
        arguments = raw_value(body, fields.get("arguments")) if "arguments" in fields else "{}"
        if not name or not arguments.startswith("{"):
            return None
        return ParsedCall(name, arguments)

    def _open_call(self, body: str) -> ParsedCall | None:
        """The call an unfinished block holds so far (None until its name is complete and its arguments object has
        begun, or the object has closed); ValueError when the block can no longer be a call."""
        j = skip_ws(body, 0)
        if j == len(body):
            return None
        if body[j] != "{":
            raise ValueError("not an object")
        fields, end = scan_object(body, j)
        if end is not None:
            rest = body[end:].lstrip()
            if rest and not self.end_tag.startswith(rest):
                raise ValueError("text after the object")
        name_span = fields.get("name")
        name = string_value(body, name_span)
        if name_span is not None and name_span[1] is not None and not name:
            raise ValueError("the name is not a string")
        args_span = fields.get("arguments")
        if args_span is not None and body[args_span[0]] != "{":
            raise ValueError("the arguments are not an object")
        if name is None or (args_span is None and end is None):  # the name goes out once its arguments begin
            return None
        return ParsedCall(name, raw_value(body, args_span))
