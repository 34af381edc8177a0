"""The Responses front end's pure parts: input items -> chat messages, tools and text.format in the chat form, the
LRU store, output items (with the reasoning seam), and the streamed event sequence."""

from __future__ import annotations

import json

import pytest

from vlserve.api.errors import APIError
from vlserve.api.responses.convert import (
    chat_request,
    chat_tool_choice,
    chat_tools,
    history_messages,
    input_messages,
    response_format,
)
from vlserve.api.responses.output import output_items
from vlserve.api.responses.protocol import (
    FunctionCallItem,
    MessageItem,
    ReasoningItem,
    ResponseObject,
    ResponsesRequest,
)
from vlserve.api.responses.store import ResponseStore, StoredResponse
from vlserve.api.responses.streaming import EventWriter, OutputStreamer
from vlserve.api.tool_choice import plan_tools


class ThinkTags:
    """A reasoning parser of the shape the seam takes: `<think>...</think>` then the answer."""

    def extract(self, text: str) -> tuple[str | None, str | None]:
        if not text.startswith("<think>"):
            return None, text
        reasoning, sep, content = text[len("<think>") :].partition("</think>")
        return reasoning, (content if sep else None)


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
    ]
    messages = input_messages(items)
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "assistant", "tool", "tool"]
    assert messages[1]["content"] == [{"type": "text", "text": "hi"}]
    assert [c["id"] for c in messages[3]["tool_calls"]] == ["c1", "c2"]  # consecutive calls: one message
    assert messages[4] == {"role": "tool", "tool_call_id": "c1", "content": "one"}
    assert input_messages("hello") == [{"role": "user", "content": "hello"}]


def test_media_parts():
    url = "data:image/png;base64,AA=="
    (msg,) = input_messages(
        [
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": url, "detail": "high"},
                    {"type": "input_file", "file_data": "data:audio/wav;base64,AA==", "filename": "a.wav"},
                    {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}},
                ],
            }
        ]
    )
    assert [p["type"] for p in msg["content"]] == ["image_url", "audio_url", "input_audio"]
    assert msg["content"][0]["image_url"] == {"url": url}
    for bad in (
        {"type": "input_image", "image_url": url, "detail": "huge"},
        {"type": "input_image", "file_id": "file-1"},
        {"type": "input_file", "file_url": "https://example.com/a.pdf"},
        {"type": "input_audio", "input_audio": "AA=="},
    ):
        with pytest.raises(APIError) as e:
            input_messages([{"role": "user", "content": [bad]}])
        assert e.value.status == 400


def test_tools_tool_choice_and_text_format_in_the_chat_form():
    tools = chat_tools([{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}])
    assert tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}]
    assert chat_tool_choice({"type": "function", "name": "f"}) == {"type": "function", "function": {"name": "f"}}
    assert chat_tool_choice("required") == "required"
    schema = {"type": "object"}
    assert response_format({"format": {"type": "json_schema", "name": "n", "schema": schema}}) == {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": schema},
    }
    assert response_format({"format": {"type": "json_object"}}) == {"type": "json_object"}
    with pytest.raises(ValueError, match="text.format.name"):
        response_format({"format": {"type": "json_schema", "schema": schema}})
    with pytest.raises(ValueError, match="colour"):
        response_format({"format": {"type": "text"}, "colour": 1})


def test_chat_request_puts_instructions_first_and_keeps_them_out_of_the_conversation():
    req = ResponsesRequest(input="again", instructions="Be brief.", max_output_tokens=5, seed=3)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chat, conversation = chat_request(req, history)
    assert chat.messages[0].role == "system" and chat.messages[0].content == "Be brief."
    assert [m.content for m in chat.messages[1:]] == ["hi", "hello", "again"]
    assert conversation == [*history, {"role": "user", "content": "again"}]
    params = chat.to_sampling_params()
    assert (params.max_tokens, params.seed) == (5, 3)
    with pytest.raises(ValueError, match="background"):
        chat_request(ResponsesRequest(input="x", background=True), [])


def test_store_evicts_the_least_recently_used():
    store = ResponseStore(2)
    a, b, c = (StoredResponse(ResponseObject(model="m"), []) for _ in range(3))
    store.put(a)
    store.put(b)
    assert store.get(a.response.id) is a  # a is now the most recently used
    store.put(c)
    assert store.get(b.response.id) is None and len(store) == 2
    assert store.delete(a.response.id) and not store.delete(a.response.id)
    with pytest.raises(ValueError):
        ResponseStore(-1)


def test_output_items_with_tool_calls_and_reasoning():
    plan = plan_tools([{"type": "function", "function": {"name": "f"}}], "required")
    items = output_items('<think>hmm</think>[{"name": "f", "parameters": {"x": 1}}]', plan, ThinkTags())
    assert isinstance(items[0], ReasoningItem) and items[0].content[0].text == "hmm"
    assert isinstance(items[1], FunctionCallItem) and (items[1].name, json.loads(items[1].arguments)) == ("f", {"x": 1})
    assert len(items) == 2  # no message when only calls remain
    plain = output_items("hello", plan_tools(None, None), None)
    assert isinstance(plain[0], MessageItem) and plain[0].content[0].text == "hello" and len(plain) == 1
    history = history_messages([{"role": "user", "content": "q"}], items)
    assert history[-1]["content"] is None and history[-1]["tool_calls"][0]["id"] == items[1].call_id


def test_streamed_events_are_ordered_and_numbered():
    write = EventWriter()
    items = OutputStreamer(write)
    events = items.reasoning("hmm") + items.text("Hel") + items.text("lo") + items.call(0, "f", '{"x"')
    events += items.call(0, None, ": 1}") + items.finish()
    parsed = [json.loads(e.split("data: ", 1)[1]) for e in events]
    assert [p["sequence_number"] for p in parsed] == list(range(len(parsed)))
    assert [p["type"] for p in parsed] == [
        "response.output_item.added",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert parsed[6]["text"] == "Hello" and parsed[12]["arguments"] == '{"x": 1}'
    assert [p.get("output_index") for p in parsed if p["type"] == "response.output_item.added"] == [0, 1, 2]
    assert all(e.startswith(f"event: {p['type']}\n") for e, p in zip(events, parsed))


def test_an_empty_stream_still_has_a_message():
    items = OutputStreamer(EventWriter())
    kinds = [json.loads(e.split("data: ", 1)[1])["type"] for e in items.finish()]
    assert kinds[0] == "response.output_item.added" and kinds[-1] == "response.output_item.done"
    assert isinstance(items.items[0], MessageItem) and items.items[0].content[0].text == ""
