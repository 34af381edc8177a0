"""Tool calling over HTTP with the openai client: tool_choice "auto" needs the server flags, tool messages and
assistant tool_calls go through the chat template with the tools, and "required" / named / "auto" (hermes) answers
come back as tool_calls, streamed the same as not (those need the engine to enforce constraints)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.api.conftest import TEXT_ENGINE_KW, start_server

CHAT = "/v1/chat/completions"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_PARAMS = {
    "type": "object",
    "required": ["city"],
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_PARAMS},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time"}},
]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
HISTORY = ASK + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]
# A small tools-aware ChatML template in the manner of Qwen2.5's (tools listed in the system turn, calls as
# <tool_call> blocks, tool results as <tool_response>).
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n{%- for tool in tools %}\n{{ tool | tojson }}"
    '{%- endfor %}\nReply with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response id=\"{{ message.tool_call_id }}\">"
    "{{ message.content }}</tool_response><|im_end|>\n"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    '{%- for call in message.tool_calls %}<tool_call>{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments | tojson }}}</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def tool_server(text_ckpt):
    """The text model with tool_choice "auto" on (hermes) and request chat templates trusted."""
    from vlserve.config import EngineArgs

    served = start_server(
        EngineArgs(model=text_ckpt, served_model_name="tiny-text", **TEXT_ENGINE_KW),
        trust_request_chat_template=True,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    yield served
    served.close()


def create(served, **kw):
    kw.setdefault("max_tokens", 200)
    kw.setdefault("temperature", 0)
    kw.setdefault("messages", ASK)
    return served.client.chat.completions.create(model=served.model, **kw)


def streamed(served, **kw) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) of a streamed request, deltas put together."""
    content, calls, finish = "", {}, None
    for chunk in create(served, stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.type == "function" and tc.id.startswith("chatcmpl-tool-")
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


# -- requests that need no constraint --------------------------------------------------------------------------------
@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_needs_the_server_flags(server, choice):
    kw = {} if choice is None else {"tool_choice": choice}
    with pytest.raises(openai.BadRequestError) as e:
        create(server, tools=TOOLS, max_tokens=2, **kw)
    assert "--enable-auto-tool-choice" in str(e.value) and "--tool-call-parser" in str(e.value)


def test_tool_choice_none_answers_in_content(server):
    r = create(server, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")
    raw = server.http.post(CHAT, json={"model": server.model, "messages": ASK, "max_tokens": 2}).json()
    assert "tool_calls" not in raw["choices"][0]["message"]


def test_tool_history_is_accepted(server):
    r = create(server, messages=HISTORY, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert r.choices[0].message.content is not None


def test_tool_messages_are_rendered_with_the_tools(tool_server, text_ckpt):
    from transformers import AutoTokenizer

    body = {
        "model": tool_server.model,
        "messages": HISTORY,
        "tools": TOOLS,
        "tool_choice": "none",
        "max_tokens": 1,
        "chat_template": TOOL_TEMPLATE,
    }
    r = tool_server.http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    tok = AutoTokenizer.from_pretrained(text_ckpt)
    conversation = [
        ASK[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    expected = tok.apply_chat_template(
        conversation, tools=TOOLS, chat_template=TOOL_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in expected
    assert '<tool_response id="call_1">sunny, 21 C</tool_response>' in expected
    assert '"name": "get_time"' in expected
    assert r.json()["usage"]["prompt_tokens"] == len(tok(expected, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize(
    "body,words",
    [
        (
            {
                "messages": ASK
                + [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    }
                ]
            },
            "not valid JSON",
        ),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "only assistant messages"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "only tool messages"),
        ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"type": "function"}]}]}, "tool_calls[0]"),
        ({"tools": [{"type": "function", "function": {}}], "tool_choice": "none"}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex and tool_choice"),
    ],
)
def test_bad_tool_requests_are_400s(server, body, words):
    r = server.http.post(CHAT, json={"model": server.model, "messages": ASK, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_auto_with_noise_gives_content(tool_server):
    r = create(tool_server, tools=TOOLS, max_tokens=16)
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


# -- constrained answers (need the engine's grammar enforcement) ------------------------------------------------------
def _check_weather(arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMS)


def test_named_function(tool_server):
    kw = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, extra_body=COMPACT)
    r = create(tool_server, **kw)
    msg = r.choices[0].message
    assert msg.content is None and r.choices[0].finish_reason == "stop"
    [(name, arguments)] = calls_of(msg)
    assert name == "get_weather" and msg.tool_calls[0].id.startswith("chatcmpl-tool-")
    _check_weather(arguments)
    assert streamed(tool_server, **kw) == ("", calls_of(msg), "stop")


def test_required(tool_server):
    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, extra_body=COMPACT)
    r = create(tool_server, **kw)
    msg = r.choices[0].message
    assert msg.content is None and r.choices[0].finish_reason == "tool_calls"
    [(name, arguments)] = calls_of(msg)
    assert name in ("get_weather", "get_time")
    if name == "get_weather":
        _check_weather(arguments)
    else:
        assert json.loads(arguments) == {}
    assert streamed(tool_server, **kw) == ("", calls_of(msg), "tool_calls")


def test_required_sampled_n(tool_server):
    r = create(
        tool_server,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        extra_body=COMPACT,
        n=3,
        temperature=1.0,
        seed=7,
    )
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1


def test_auto_hermes_calls_are_extracted(tool_server):
    """The grammar makes the noise model write a hermes block; the parser turns it into a tool call."""
    regex = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'
    kw = dict(tools=TOOLS, tool_choice="auto", extra_body={"guided_regex": regex})
    r = create(tool_server, **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    [(name, arguments)] = calls_of(msg)
    assert name == "get_weather"
    _check_weather(arguments)
    assert streamed(tool_server, **kw) == ("", calls_of(msg), "tool_calls")


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"enable_auto_tool_choice": True}, "needs --tool-call-parser (one of hermes"),
        ({"tool_call_parser": "nope"}, "known: hermes"),
    ],
)
def test_server_tool_flags_are_checked_at_start(kw, words):
    from types import SimpleNamespace

    from vlserve.api.serving_chat import OpenAIServingChat

    engine = SimpleNamespace(
        engine_args=SimpleNamespace(limit_mm_per_prompt={}, mm_processor_kwargs=None, reasoning_parser=None),
        input_processor=SimpleNamespace(mm_processor=None),
    )
    fetcher = SimpleNamespace(config=None)  # the default media settings
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        OpenAIServingChat(engine, None, fetcher, **kw)
    assert (
        OpenAIServingChat(
            engine, None, fetcher, enable_auto_tool_choice=True, tool_call_parser="hermes"
        ).auto_tool_parser
        is not None
    )
