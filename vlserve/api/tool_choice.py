"""`tools` and `tool_choice` of a chat request -> a ToolPlan: the tools the chat template gets, the output constraint,
and how each choice's text becomes tool calls (non-streamed and streamed alike).

- no tool_choice: "auto" when tools are given, else "none" (vLLM's default);
- "none": the tools still go to the chat template; the output is plain content;
- "auto": needs --enable-auto-tool-choice and --tool-call-parser; the parser reads calls out of the text;
  finish_reason "tool_calls" when it found some;
- "required": the output is constrained to a JSON array of at least one {"name": <a tool's name>, "parameters":
  <that tool's parameters>} (one anyOf branch per tool; at most one item when parallel_tool_calls is false);
  finish_reason "tool_calls";
- {"type": "function", "function": {"name": X}}: constrained to X's parameters schema; the whole output is the
  arguments of one call to X; finish_reason stays the engine's ("stop"), as in vLLM.
In every tool mode but "none", content is null when only tool calls remain. A finish_reason other than "stop"
(e.g. "length") is kept.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from vlserve.api.tool_parsers import ParsedCall, ToolParser
from vlserve.api.tool_parsers.partial_json import raw_value, scan_object_array, string_value
from vlserve.shorten import shorten

TOOL_CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_DEFS_KEYS = ("$defs", "definitions")
AUTO_NEEDS_FLAGS = (
    'tool_choice "auto" (the default when tools are given) needs the server started with '
    '--enable-auto-tool-choice and --tool-call-parser; send tool_choice "none", "required" or '
    '{"type": "function", "function": {"name": ...}} instead'
)


def validate_tools(tools: Any) -> list[dict]:
    """The request's function tools, checked (ValueError naming the bad entry); they reach the template as sent."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError('tools must be a list of {"type": "function", "function": {"name": ...}}')
    names: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where} must be an object, got {shorten(tool)}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"{where}.type {shorten(tool.get('type'))} is not supported; only function tools are")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name must be a non-empty string, got {shorten(name)}")
        if name in names:
            raise ValueError(f"{where}: two tools are named {shorten(name)}")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"{where}.function.description must be a string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ValueError(
                f"{where}.function.parameters must be a JSON schema object, got {shorten(fn['parameters'])}"
            )
        if fn.get("strict") not in (None, True, False):
            raise ValueError(f"{where}.function.strict must be true or false")
        out.append({**tool, "type": "function"})
    return out


def _parameters(tool: dict) -> dict:
    return copy.deepcopy(tool["function"].get("parameters")) or dict(EMPTY_PARAMETERS)


def _hoist_defs(schema: dict, defs: dict[str, dict]) -> None:
    """Move a tool's $defs (or definitions) into `defs`, for refs that point at the root of the combined schema."""
    for key in _DEFS_KEYS:
        for name, sub in (schema.pop(key, None) or {}).items():
            known = defs.setdefault(key, {})
            if name in known and known[name] != sub:
                raise ValueError(
                    f"tools: {key} {shorten(name)} has different schemas in two tools; "
                    f'tool_choice "required" needs one schema per definition name'
                )
            known[name] = sub


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """JSON schema of a "required" answer: [{"name": <one tool's name>, "parameters": <its parameters>}, ...]."""
    defs: dict[str, dict] = {}
    variants = []
    for tool in tools:
        params = _parameters(tool)
        _hoist_defs(params, defs)
        variants.append(
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "parameters"],
                "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]}, "parameters": params},
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


def named_schema(tools: list[dict], name: str) -> dict:
    """JSON schema of a named function's arguments (an empty object when it declares no parameters)."""
    return _parameters(next(t for t in tools if t["function"]["name"] == name))


class NamedFunctionParser(ToolParser):
    """tool_choice naming a function: the whole output is the arguments of one call to it."""

    def __init__(self, name: str):
        super().__init__(max_calls=1)
        self.name = name

    def parse(self, text: str, finished: bool) -> tuple[str, list[ParsedCall]]:
        if not text and not finished:
            return "", []
        return "", [ParsedCall(self.name, text)]


class RequiredToolsParser(ToolParser):
    """tool_choice "required": the output is a JSON array of {"name", "parameters"}; anything else (an output cut
    short) is returned as content."""

    def parse(self, text: str, finished: bool) -> tuple[str, list[ParsedCall]]:
        try:
            if finished:
                items = json.loads(text)
                if not isinstance(items, list) or not all(
                    isinstance(i, dict)
                    and isinstance(i.get("name"), str)
                    and i["name"]
                    and isinstance(i.get("parameters"), dict)
                    for i in items
                ):
                    return text, []
            calls = []
            for item in scan_object_array(text):
                name = string_value(text, item.get("name"))
                if name is None:
                    break
                calls.append(ParsedCall(name, raw_value(text, item.get("parameters"))))
        except ValueError:
            return (text, []) if finished else ("", [])
        return "", calls


@dataclass
class ToolPlan:
    """What a chat request's tools and tool_choice mean. `mode`: "none", "auto", "required" or "function"."""

    mode: str = "none"
    tools: list[dict] | None = None
    function: str | None = None  # the named function (mode "function")
    parallel: bool = True  # parallel_tool_calls
    parser_class: type[ToolParser] | None = None  # mode "auto"

    def constraint(self) -> dict | None:
        """The JSON schema the output must follow (None: unconstrained by tools)."""
        if self.mode == "required":
            return required_schema(self.tools or [], self.parallel)
        if self.mode == "function":
            return named_schema(self.tools or [], self.function)
        return None

    def new_parser(self) -> ToolParser | None:
        """A fresh parser for one choice (None: the text is plain content)."""
        limit = None if self.parallel else 1
        if self.mode == "auto":
            return self.parser_class(max_calls=limit)
        if self.mode == "required":
            return RequiredToolsParser(max_calls=limit)
        if self.mode == "function":
            return NamedFunctionParser(self.function)
        return None

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """ "tool_calls" instead of "stop" when calls were made in "auto" or "required" mode."""
        if reason == "stop" and called and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def plan_tools(
    tools: Any, tool_choice: Any, parallel_tool_calls: bool | None = None, auto_parser: type[ToolParser] | None = None
) -> ToolPlan:
    """The plan for a request (ValueError naming the problem). `auto_parser`: the server's tool-call parser when
    --enable-auto-tool-choice is on, else None (then "auto" is refused)."""
    checked = validate_tools(tools)
    parallel = parallel_tool_calls is not False
    choice = tool_choice if tool_choice is not None else ("auto" if checked else "none")
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ValueError(
                f'tool_choice must be "none", "auto", "required" or {{"type": "function", '
                f'"function": {{"name": ...}}}}, got {shorten(choice)}'
            )
        if choice == "none":
            return ToolPlan("none", checked or None, parallel=parallel)
        if not checked:
            raise ValueError(f'tool_choice "{choice}" needs tools')
        if choice == "auto" and auto_parser is None:
            raise ValueError(AUTO_NEEDS_FLAGS)
        return ToolPlan(choice, checked, parallel=parallel, parser_class=auto_parser)
    if not isinstance(choice, dict) or choice.get("type", "function") != "function":
        raise ValueError(
            f'tool_choice {shorten(choice)} is not supported; use "none", "auto", "required" or '
            f'{{"type": "function", "function": {{"name": ...}}}}'
        )
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError("tool_choice.function.name must be a non-empty string")
    known = [t["function"]["name"] for t in checked]
    if name not in known:
        raise ValueError(
            f"tool_choice names function {shorten(name)}, which is not in tools "
            f"({', '.join(shorten(k) for k in known) or 'none given'})"
        )
    return ToolPlan("function", checked, function=name, parallel=parallel)
