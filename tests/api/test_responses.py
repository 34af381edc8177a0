"""POST /v1/responses with the openai client against a real server on a tiny text model (its chat template renders
tools, calls and tool results): text and two turns give the chat endpoint's greedy tokens for the same conversation,
streamed events put together give the non-streamed Response, function calls come back as function_call items and
their outputs feed the next turn, json_schema output validates, and bad input is a 4xx."""

from __future__ import annotations

import json
import os
import shutil

import jsonschema
import openai
import pytest

from tests.api.conftest import TEXT_ENGINE_KW, start_server
from tests.api.test_tool_calls import TOOL_TEMPLATE, WEATHER_PARAMS

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_PARAMS},
    {"type": "function", "name": "get_time", "description": "The time"},
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
GREEDY = {"temperature": 0}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tool_ckpt(text_ckpt, tmp_path_factory) -> str:
    """The tiny text checkpoint with a tools-aware chat template."""
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("responses_ckpt") / "model")
    shutil.copytree(text_ckpt, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(path)
    assert os.path.exists(os.path.join(path, "config.json"))
    return path


@pytest.fixture(scope="module")
def rserver(tool_ckpt):
    from vlserve.config import EngineArgs

    served = start_server(
        EngineArgs(
            model=tool_ckpt,
            served_model_name="tiny-text",
            structured_outputs_config={"disable_any_whitespace": True},
            **TEXT_ENGINE_KW,
        ),
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    yield served
    served.close()


def respond(served, **kw):
    kw.setdefault("max_output_tokens", 12)
    return served.client.responses.create(model=served.model, **GREEDY, **kw)


def chat_text(served, messages, max_tokens=12, **kw) -> tuple[str, object]:
    r = served.client.chat.completions.create(
        model=served.model, messages=messages, max_tokens=max_tokens, **GREEDY, **kw
    )
    return r.choices[0].message.content, r


def test_text_is_the_chat_endpoints_greedy_text(rserver):
    r = respond(rserver, input="What is the weather in Paris?", instructions="Be brief.")
    text, chat = chat_text(
        rserver,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}],
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == text and text
    assert r.status in ("completed", "incomplete")
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.output[0].status == "incomplete"


def test_two_turns_follow_the_stored_conversation(rserver):
    first = respond(rserver, input="Name a city.", instructions="Answer in one word.")
    second = respond(rserver, input="And another one?", previous_response_id=first.id)
    # instructions are not carried into the next turn
    messages = [
        {"role": "user", "content": "Name a city."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another one?"},
    ]
    text, chat = chat_text(rserver, messages)
    assert second.output_text == text
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    again = respond(rserver, input="And another one?", previous_response_id=first.id)  # the same prompt again
    assert again.output_text == second.output_text
    assert again.usage.input_tokens_details.cached_tokens > 0  # from the prefix cache


def test_stream_events_build_the_non_streamed_response(rserver):
    kw = dict(input="Tell me about Rome.", max_output_tokens=10)
    whole = respond(rserver, **kw)
    with rserver.client.responses.stream(model=rserver.model, **GREEDY, **kw) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert kinds[-1] == ("response.completed" if final.status == "completed" else "response.incomplete")
    assert rserver.client.responses.retrieve(final.id).output_text == whole.output_text


def test_function_call_then_its_output_next_turn(rserver):
    ask = "What is the weather in Paris?"
    r = respond(
        rserver, input=ask, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_output_tokens=100
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and r.status == "completed", r.output
    for call in calls:
        assert call.name in ("get_weather", "get_time") and call.call_id
        if call.name == "get_weather":
            jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny, 21 C"} for c in calls]
    follow = respond(rserver, input=results, previous_response_id=r.id, tools=TOOLS, tool_choice="none")
    # the same conversation through the chat endpoint
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
        ],
    }
    tool_msgs = [{"role": "tool", "tool_call_id": c.call_id, "content": "sunny, 21 C"} for c in calls]
    messages = [{"role": "user", "content": ask}, assistant, *tool_msgs]
    text, chat = chat_text(rserver, messages, tools=CHAT_TOOLS, tool_choice="none")
    assert follow.output_text == text
    assert follow.usage.input_tokens == chat.usage.prompt_tokens


def test_named_function_streams_argument_deltas(rserver):
    kw = dict(
        input="Weather in Rome?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
    )
    whole = respond(rserver, **kw)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    with rserver.client.responses.stream(model=rserver.model, **GREEDY, **kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert "response.output_text.delta" not in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments
    (streamed,) = final.output
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)


def test_json_schema_output_is_valid(rserver):
    r = respond(
        rserver,
        input="Plan a trip.",
        text={"format": {"type": "json_schema", "name": "trip", "schema": SCHEMA, "strict": True}},
        max_output_tokens=100,
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"
    obj = respond(rserver, input="Any JSON.", text={"format": {"type": "json_object"}}, max_output_tokens=60)
    assert obj.status != "completed" or isinstance(json.loads(obj.output_text), dict)


def test_retrieve_delete_and_unstored(rserver):
    r = respond(rserver, input="hi", max_output_tokens=3)
    got = rserver.client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    rserver.client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        rserver.client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        rserver.client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        respond(rserver, input="hi", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    unstored = respond(rserver, input="hi", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        rserver.client.responses.retrieve(unstored.id)


BAD_REQUESTS = [
    ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
    ({"input": [{"role": "user", "content": [{"type": "input_video", "url": "x"}]}]}, "input_video"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "role"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]},
        "image",
    ),
    (
        {
            "input": [
                {"role": "user", "content": [{"type": "input_file", "file_data": "data:application/pdf;base64,AA=="}]}
            ]
        },
        "application/pdf",
    ),
    ({"input": [{"type": "function_call", "name": "f"}]}, "call_id"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "web_search"),
    ({"input": "hi", "tool_choice": "auto", "tools": [{"type": "function", "name": "f", "oops": 1}]}, "oops"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": []}, "no message"),
]


@pytest.mark.parametrize(("body", "named"), BAD_REQUESTS)
def test_bad_input_is_a_4xx_and_the_server_lives_on(rserver, body, named):
    r = rserver.http.post("/v1/responses", json={"model": rserver.model, **body})
    assert 400 <= r.status_code < 500, r.text
    assert named in r.json()["error"]["message"], r.text
    assert rserver.http.get("/health").status_code == 200
    assert respond(rserver, input="still here", max_output_tokens=2).output_text is not None


def test_media_the_model_lacks_names_the_input_field(rserver):
    image = {"type": "input_image", "image_url": "data:image/png;base64,AA=="}
    r = rserver.http.post(
        "/v1/responses", json={"model": rserver.model, "input": [{"role": "user", "content": [image]}]}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


def test_store_evicts_the_least_recently_used(text_ckpt):
    from vlserve.config import EngineArgs

    served = start_server(
        EngineArgs(model=text_ckpt, served_model_name="tiny-text", **TEXT_ENGINE_KW), responses_store_size=2
    )
    try:
        a, b = (respond(served, input=t, max_output_tokens=2) for t in ("a", "b"))
        served.client.responses.retrieve(a.id)  # a is now the most recently used: b goes first
        c = respond(served, input="c", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            served.client.responses.retrieve(b.id)
        assert served.client.responses.retrieve(a.id).id == a.id
        assert served.client.responses.retrieve(c.id).id == c.id
        respond(served, input="d", max_output_tokens=2, previous_response_id=c.id)  # uses c, then stores d
        with pytest.raises(openai.NotFoundError):
            served.client.responses.retrieve(a.id)
    finally:
        served.close()


class FirstWordReasons:
    """A reasoning parser of the shape the seam takes: the text up to the first space is reasoning (none until it
    is written), the rest content."""

    def extract(self, text: str) -> tuple[str | None, str | None]:
        reasoning, sep, content = text.partition(" ")
        return (reasoning, content) if sep else (text, None)


def test_reasoning_seam_streamed_and_not(rserver):
    serving = rserver.thread.server.config.app.state.responses
    serving.reasoning_parser = FirstWordReasons
    try:
        kw = dict(input="Tell me about Rome.", max_output_tokens=12)
        whole = respond(rserver, **kw)
        plain = chat_text(rserver, [{"role": "user", "content": "Tell me about Rome."}])[0]
        with rserver.client.responses.stream(model=rserver.model, **GREEDY, **kw) as stream:
            events = list(stream)
    finally:
        serving.reasoning_parser = None
    reasoning, _, content = plain.partition(" ")
    assert reasoning and content  # the greedy text has both parts
    assert [i.type for i in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == reasoning and whole.output_text == content
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == reasoning and final.output_text == content
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == content
