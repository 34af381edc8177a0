"""Tool calling without an engine: the hermes parser (several calls, malformed blocks, streamed == non-streamed),
the "required" / named-function schemas (validated with jsonschema) and parsers, tools / tool_choice planning."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from vlserve.api.tool_choice import (
    AUTO_NEEDS_FLAGS,
    NamedFunctionParser,
    RequiredToolsParser,
    ToolPlan,
    named_schema,
    plan_tools,
    required_schema,
)
from vlserve.api.tool_parsers import HermesToolParser, ToolParser, ToolParserManager
from vlserve.api.tool_parsers.partial_json import scan_object, scan_object_array

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
            "required": ["city"],
            "$defs": {"Unit": {"enum": ["C", "F"]}},
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, CLOCK]


def block(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def calls_of(tool_calls) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in tool_calls]


def stream(parser: ToolParser, text: str, sizes) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Feed `text` cumulatively in pieces; (content, [(name, arguments)], ids) from the concatenated deltas."""
    content, names, args, ids = "", {}, {}, {}
    pos = 0
    while pos < len(text):
        pos = min(len(text), pos + next(sizes))
        deltas = [parser.extract_tool_calls_streaming(text[:pos], finished=pos == len(text))]
        for d in deltas:
            if d is None:
                continue
            content += d.content or ""
            for tc in d.tool_calls or []:
                if tc.id is not None:
                    assert tc.index not in ids and tc.type == "function" and tc.id.startswith("chatcmpl-tool-")
                    ids[tc.index] = tc.id
                    names[tc.index] = tc.function.name
                else:
                    assert tc.function.name is None  # the name goes out once, with the id
                args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
    if not text:
        d = parser.extract_tool_calls_streaming("", finished=True)
        content += (d.content or "") if d else ""
        for tc in (d.tool_calls or []) if d else []:
            ids[tc.index], names[tc.index], args[tc.index] = tc.id, tc.function.name, tc.function.arguments or ""
    assert sorted(ids) == list(range(len(ids)))
    return content, [(names[i], args[i]) for i in sorted(ids)], list(ids.values())


def chunkings():
    """Piece sizes: one character at a time, then a few seeded random splits."""
    yield lambda: iter(lambda: 1, None)
    for seed in range(4):
        rng = random.Random(seed)
        yield lambda rng=rng: iter(lambda: rng.randint(1, 9), None)


HERMES_CASES = {
    "one call": block("get_weather", '{"city": "Paris"}'),
    "content then calls": "Let me check both.\n"
    + block("get_weather", '{"city": "Paris", "unit": "C"}')
    + "\n"
    + block("get_time", "{}"),
    "tricky strings": block("get_weather", '{"city": "a}\\"b{ </tool", "n": [1, {"x": null}], "t": true}'),
    "no arguments key": '<tool_call>{"name": "get_time"}</tool_call>',
    "malformed json": "Sure <tool_call>{not json}</tool_call> done",
    "not an object": "<tool_call>[1, 2]</tool_call>",
    "arguments not an object": '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
    "malformed then valid": "<tool_call>oops</tool_call>\n" + block("get_time", "{}") + "\nbye  ",
    "plain text": "Hello world, <toolbox> is not a tag <tool_cal",
    "unclosed valid": "ok " + '<tool_call>\n{"name": "get_time", "arguments": {}}\n',
    "unclosed invalid": 'ok <tool_call>\n{"name": "get_time", "argu',
    "text after call": block("get_time", "{}") + "\n\nThat is all.\n",
    "unicode": block("get_weather", '{"city": "Zürich ✓"}'),
    "empty": "",
}


@pytest.mark.parametrize("case", list(HERMES_CASES))
def test_hermes_streaming_equals_non_streaming(case):
    text = HERMES_CASES[case]
    content, tool_calls = HermesToolParser().extract_tool_calls(text)
    expected = calls_of(tool_calls)
    for sizes in chunkings():
        got_content, got_calls, ids = stream(HermesToolParser(), text, sizes())
        assert got_calls == expected, case
        assert got_content == (content or ""), case
        assert len(set(ids)) == len(ids)


def test_hermes_extracts_several_calls_and_content():
    content, calls = HermesToolParser().extract_tool_calls(HERMES_CASES["content then calls"])
    assert content == "Let me check both."
    assert calls_of(calls) == [("get_weather", '{"city": "Paris", "unit": "C"}'), ("get_time", "{}")]
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in calls)
    assert len({c.id for c in calls}) == 2
    for c in calls:
        json.loads(c.function.arguments)


def test_hermes_only_calls_gives_null_content():
    content, calls = HermesToolParser().extract_tool_calls(HERMES_CASES["one call"])
    assert content is None and calls_of(calls) == [("get_weather", '{"city": "Paris"}')]
    assert (
        HermesToolParser().extract_tool_calls('<tool_call>{"name": "get_time"}</tool_call>')[1][0].function.arguments
        == "{}"
    )


@pytest.mark.parametrize(
    "case", ["malformed json", "not an object", "arguments not an object", "plain text", "unclosed invalid", "empty"]
)
def test_hermes_malformed_blocks_stay_content(case):
    text = HERMES_CASES[case]
    assert HermesToolParser().extract_tool_calls(text) == (text, [])


def test_hermes_malformed_block_next_to_a_valid_one():
    content, calls = HermesToolParser().extract_tool_calls(HERMES_CASES["malformed then valid"])
    assert content == "<tool_call>oops</tool_call>bye  "
    assert calls_of(calls) == [("get_time", "{}")]


def test_hermes_unclosed_last_block_counts_when_its_json_is_whole():
    content, calls = HermesToolParser().extract_tool_calls(HERMES_CASES["unclosed valid"])
    assert content == "ok" and calls_of(calls) == [("get_time", "{}")]


def test_hermes_streaming_holds_back_a_possible_tag():
    parser = HermesToolParser()
    assert parser.extract_tool_calls_streaming("Hello <tool").content == "Hello"
    assert parser.extract_tool_calls_streaming('Hello <tool_call>\n{"na') is None
    delta = parser.extract_tool_calls_streaming('Hello <tool_call>\n{"name": "get_time", "arguments": {"a')
    assert delta.content is None and delta.tool_calls[0].function.name == "get_time"
    assert delta.tool_calls[0].function.arguments == '{"a'
    delta = parser.extract_tool_calls_streaming('Hello <tool_call>\n{"name": "get_time", "arguments": {"a": 1}}')
    assert delta.tool_calls[0].id is None and delta.tool_calls[0].function.arguments == '": 1}'
    assert parser.streamed_calls == 1


def test_max_calls_keeps_the_first():
    text = HERMES_CASES["content then calls"]
    content, calls = HermesToolParser(max_calls=1).extract_tool_calls(text)
    assert calls_of(calls) == [("get_weather", '{"city": "Paris", "unit": "C"}')]
    _, streamed, _ = stream(HermesToolParser(max_calls=1), text, iter(lambda: 3, None))
    assert streamed == calls_of(calls)


def test_registry():
    assert ToolParserManager.get("hermes") is HermesToolParser
    assert "hermes" in ToolParserManager.names()
    with pytest.raises(ValueError, match="unknown tool call parser.*known: .*hermes"):
        ToolParserManager.get("nope")

    @ToolParserManager.register("test-upper")
    class Upper(ToolParser):
        def parse(self, text, finished):
            return text.upper(), []

    try:
        assert ToolParserManager.get("test-upper")().extract_tool_calls("hi") == ("HI", [])
    finally:
        ToolParserManager._parsers.pop("test-upper")
    with pytest.raises(TypeError):
        ToolParserManager.register("bad")(dict)


def test_partial_json_spans():
    text = '{"a": "x\\"}", "b": [1, {"c": 2}], "d": 3.5, "e": null}'
    fields, end = scan_object(text, 0)
    assert end == len(text)
    assert {k: text[s:e] for k, (s, e) in fields.items()} == {
        "a": '"x\\"}"',
        "b": '[1, {"c": 2}]',
        "d": "3.5",
        "e": "null",
    }
    fields, end = scan_object('{"a": [1, 2', 0)
    assert end is None and fields["a"] == (6, None)
    with pytest.raises(ValueError):
        scan_object('{"a": [1}', 0)
    with pytest.raises(ValueError):
        scan_object('{"a": nope,', 0)
    assert len(scan_object_array('[{"a": 1}, {"b"')) == 2
    with pytest.raises(ValueError):
        scan_object_array("{}")


# -- "required" and named-function constraints ---------------------------------------------------------------------
def test_required_schema_accepts_exactly_the_tool_calls():
    schema = required_schema(TOOLS)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [
        [{"name": "get_weather", "parameters": {"city": "Paris"}}],
        [{"name": "get_weather", "parameters": {"city": "Rome", "unit": "F"}}, {"name": "get_time", "parameters": {}}],
    ]
    bad = [
        [],
        [{"name": "get_weather", "parameters": {}}],
        [{"name": "other", "parameters": {}}],
        [{"name": "get_weather", "parameters": {"city": "Rome", "unit": "K"}}],
        [{"name": "get_time", "parameters": {}, "extra": 1}],
        [{"name": "get_time"}],
        {"name": "get_time", "parameters": {}},
    ]
    for value in good:
        jsonschema.validate(value, schema)
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
    assert "$defs" in WEATHER["function"]["parameters"]  # the request's tools are not changed
    single = required_schema(TOOLS, parallel=False)
    jsonschema.validate(good[0], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good[1], single)


def test_required_schema_refuses_clashing_defs():
    other = {
        "type": "function",
        "function": {"name": "g", "parameters": {"type": "object", "$defs": {"Unit": {"enum": ["K"]}}}},
    }
    with pytest.raises(ValueError, match="Unit"):
        required_schema([WEATHER, other])


def test_named_schema():
    schema = named_schema(TOOLS, "get_weather")
    jsonschema.validate({"city": "Paris", "unit": "C"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"unit": "C"}, schema)
    assert named_schema(TOOLS, "get_time") == {"type": "object", "properties": {}}


def test_required_parser_streams_what_it_returns():
    text = json.dumps(
        [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    )
    content, calls = RequiredToolsParser().extract_tool_calls(text)
    assert content is None
    assert calls_of(calls) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    for sizes in chunkings():
        assert stream(RequiredToolsParser(), text, sizes())[:2] == ("", calls_of(calls))
    cut = text[:25]  # cut short by max_tokens: no calls, the text comes back as content
    assert RequiredToolsParser().extract_tool_calls(cut) == (cut, [])


def test_named_parser():
    content, calls = NamedFunctionParser("get_weather").extract_tool_calls('{"city": "Paris"}')
    assert content is None and calls_of(calls) == [("get_weather", '{"city": "Paris"}')]
    assert stream(NamedFunctionParser("get_weather"), '{"city": "Paris"}', iter(lambda: 2, None))[1] == calls_of(calls)


# -- planning ----------------------------------------------------------------------------------------------------
def test_plan_defaults_and_modes():
    assert plan_tools(None, None).mode == "none"
    none = plan_tools(TOOLS, "none")
    assert none.mode == "none" and none.tools == TOOLS and none.constraint() is None and none.new_parser() is None
    auto = plan_tools(TOOLS, None, auto_parser=HermesToolParser)
    assert auto.mode == "auto" and auto.constraint() is None and isinstance(auto.new_parser(), HermesToolParser)
    assert auto.new_parser() is not auto.new_parser()
    required = plan_tools(TOOLS, "required", parallel_tool_calls=False)
    assert required.constraint() == required_schema(TOOLS, parallel=False)
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert named.mode == "function" and named.constraint() == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    "tools,choice,words",
    [
        (TOOLS, None, "--enable-auto-tool-choice"),
        (TOOLS, "auto", "--enable-auto-tool-choice"),
        (None, "required", "needs tools"),
        (None, "auto", "needs tools"),
        (TOOLS, "sometimes", "tool_choice must be"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "nope"),
        (TOOLS, {"type": "function", "function": {}}, "tool_choice.function.name"),
        (TOOLS, {"type": "allowed_tools"}, "not supported"),
        (None, {"type": "function", "function": {"name": "get_time"}}, "not in tools"),
        ({"a": 1}, "none", "tools must be a list"),
        ([{"type": "custom", "custom": {}}], "none", "only function tools"),
        ([{"type": "function", "function": {"description": "x"}}], "none", "tools[0].function.name"),
        ([{"type": "function"}], "none", "tools[0].function"),
        ([CLOCK, CLOCK], "none", "two tools are named"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "none", "parameters"),
        (["f"], "none", "tools[0] must be an object"),
    ],
)
def test_plan_errors(tools, choice, words):
    with pytest.raises(ValueError) as e:
        plan_tools(tools, choice)
    assert words in str(e.value)
    if words == "--enable-auto-tool-choice":
        assert str(e.value) == AUTO_NEEDS_FLAGS


def test_finish_reasons():
    assert ToolPlan("auto").finish_reason("stop", True) == "tool_calls"
    assert ToolPlan("auto").finish_reason("stop", False) == "stop"
    assert ToolPlan("required").finish_reason("stop", True) == "tool_calls"
    assert ToolPlan("required").finish_reason("length", True) == "length"
    assert ToolPlan("function").finish_reason("stop", True) == "stop"
    assert ToolPlan("none").finish_reason(None, False) is None
