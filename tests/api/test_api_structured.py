"""Structured outputs over the API: how request fields map onto SamplingParams.structured_outputs (pure, no engine),
no request field silently dropped, and over HTTP (openai client, tiny random checkpoint: its unconstrained text is
noise, so a valid output is the grammar's doing) outputs that satisfy the constraint."""

from __future__ import annotations

import itertools
import json
import logging
import re

import jsonschema
import openai
import pytest

from vlserve.api.protocol import ChatCompletionRequest, CompletionRequest
from vlserve.structured_output import StructuredOutputsParams

MSG = [{"role": "user", "content": "Describe the picture as JSON."}]
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["shape", "color", "big"],
    "properties": {
        "shape": {"enum": ["circle", "square", "triangle"]},
        "color": {"enum": ["red", "green", "blue"]},
        "big": {"type": "boolean"},
    },
}
COMPACT = {"disable_any_whitespace": True}


def chat_params(**body):
    return ChatCompletionRequest(messages=MSG, **body).to_sampling_params()


def so_of(**body) -> StructuredOutputsParams | None:
    return chat_params(**body).structured_outputs


# -- mapping -----------------------------------------------------------------------------------------------------
SOURCES = {  # request fields -> (kind, value) they constrain to
    "response_format json_object": ({"response_format": {"type": "json_object"}}, "json_object", True),
    "response_format json_schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "scene", "schema": SCHEMA, "strict": True},
            }
        },
        "json",
        SCHEMA,
    ),
    "response_format structural_tag": (
        {
            "response_format": {
                "type": "structural_tag",
                "structures": [{"begin": "<a>", "schema": SCHEMA, "end": "</a>"}],
                "triggers": ["<a>"],
            }
        },
        "structural_tag",
        None,
    ),
    "structured_outputs.json": ({"structured_outputs": {"json": SCHEMA}}, "json", SCHEMA),
    "structured_outputs.regex": ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
    "structured_outputs.choice": ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
    "structured_outputs.grammar": ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"'),
    "structured_outputs.json_object": ({"structured_outputs": {"json_object": True}}, "json_object", True),
    "structured_outputs.structural_tag": (
        {"structured_outputs": {"structural_tag": '{"type": "x"}'}},
        "structural_tag",
        '{"type": "x"}',
    ),
    "guided_json": ({"guided_json": json.dumps(SCHEMA)}, "json", json.dumps(SCHEMA)),
    "guided_regex": ({"guided_regex": "[0-9]{3}"}, "regex", "[0-9]{3}"),
    "guided_choice": ({"guided_choice": ["a", "b"]}, "choice", ["a", "b"]),
    "guided_grammar": ({"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"'),
    "structural_tag": ({"structural_tag": '{"type": "y"}'}, "structural_tag", '{"type": "y"}'),
}


@pytest.mark.parametrize("name", list(SOURCES))
def test_each_field_maps_to_one_constraint(name):
    body, kind, value = SOURCES[name]
    for make in (
        lambda: so_of(**body),
        lambda: CompletionRequest(prompt="x", **body).to_sampling_params().structured_outputs,
    ):
        so = make()
        assert so.kind == kind
        if value is not None:
            assert getattr(so, kind) == value
        assert so.disable_any_whitespace is None


def test_structural_tag_response_format_is_passed_whole():
    body = SOURCES["response_format structural_tag"][0]
    assert so_of(**body).structural_tag == body["response_format"]


def test_no_constraint():
    assert so_of() is None
    assert so_of(response_format={"type": "text"}) is None
    assert so_of(guided_whitespace_pattern=r"\s*", guided_decoding_backend="xgrammar") is None  # no effect alone


@pytest.mark.parametrize(
    "a,b",
    list(
        itertools.combinations(
            [
                "response_format json_schema",
                "structured_outputs.regex",
                "guided_json",
                "guided_choice",
                "guided_grammar",
                "structural_tag",
            ],
            2,
        )
    ),
)
def test_two_constraints_are_refused_naming_both(a, b):
    body = {**SOURCES[a][0], **SOURCES[b][0]}
    with pytest.raises(ValueError) as e:
        so_of(**body)
    assert a in str(e.value) and b in str(e.value) and "one output constraint" in str(e.value)


def test_two_kinds_inside_structured_outputs_are_refused():
    with pytest.raises(ValueError, match="structured_outputs.regex and structured_outputs.choice"):
        so_of(structured_outputs={"regex": "a", "choice": ["a"]})


def test_tool_constraint_conflicts_with_others():
    assert ChatCompletionRequest(messages=MSG).to_sampling_params(tool_schema=SCHEMA).structured_outputs.json == SCHEMA
    with pytest.raises(ValueError, match="guided_regex and tool_choice"):
        ChatCompletionRequest(messages=MSG, guided_regex="a").to_sampling_params(tool_schema=SCHEMA)


def test_whitespace_options():
    so = so_of(response_format={"type": "json_object"}, structured_outputs=COMPACT)
    assert so.json_object and so.disable_any_whitespace is True
    so = so_of(structured_outputs={"json": SCHEMA, "disable_any_whitespace": False})
    assert so.disable_any_whitespace is False
    so = so_of(guided_json=SCHEMA, guided_decoding_backend="xgrammar:disable-any-whitespace,no-fallback")
    assert so.disable_any_whitespace is True
    assert so_of(guided_json=SCHEMA, guided_decoding_backend="auto").disable_any_whitespace is None
    assert so_of(guided_regex="a+", guided_whitespace_pattern=" ").regex == "a+"  # only JSON takes whitespace


@pytest.mark.parametrize(
    "body,words",
    [
        ({"structured_outputs": COMPACT}, "structured_outputs sets no constraint"),
        ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}}, "whitespace_pattern"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice: "),
        ({"structured_outputs": "json"}, "structured_outputs must be an object"),
        ({"guided_choice": []}, "guided_choice: "),
        ({"guided_choice": ["a", 1]}, "guided_choice: "),
        ({"guided_regex": ""}, "guided_regex: "),
        ({"guided_json": "{not json"}, "guided_json: "),
        ({"guided_json": 5}, "guided_json: "),
        ({"guided_json": SCHEMA, "guided_whitespace_pattern": r"[ ]?"}, "guided_whitespace_pattern"),
        ({"guided_json": SCHEMA, "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"guided_json": SCHEMA, "guided_decoding_backend": "guidance"}, "xgrammar"),
        ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar:fast"}, "option"),
        ({"response_format": {"type": "yaml"}}, "response_format.type must be one of"),
        ({"response_format": "json"}, "response_format must be an object"),
        ({"response_format": {"type": "json_schema"}}, "needs a json_schema object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "json_schema.name"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "y"}}},
            "strict",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "extra": 1}}},
            "extra",
        ),
        ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "schema"),
    ],
)
def test_bad_constraints_name_the_field(body, words):
    with pytest.raises(ValueError) as e:
        so_of(**body)
    assert words in str(e.value)


def test_other_server_backend():
    req = ChatCompletionRequest(messages=MSG, guided_json=SCHEMA, guided_decoding_backend="guidance")
    assert req.to_sampling_params(structured_backend="guidance").structured_outputs.json == SCHEMA


# -- no silent drops -----------------------------------------------------------------------------------------------
CHANGING = {
    "best_of": 2,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "spaces_between_special_tokens": False,
    "logits_processors": ["a.b"],
    "return_tokens_as_token_ids": True,
    "vllm_xargs": {"a": 1},
    "prompt_embeds": "AAAA",
}
CHAT_ONLY = {
    "documents": [{"text": "x"}],
    "reasoning_effort": "low",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "audio": {"voice": "x"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
}
NO_OPS = {
    "logit_bias": {},
    "best_of": 1,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "spaces_between_special_tokens": True,
    "truncate_prompt_tokens": None,
    "prompt_logprobs": None,
    "bad_words": [],
    "priority": 0,
    "echo": False,
    "add_generation_prompt": True,
    "modalities": ["text"],
    "request_id": "abc",
    "metadata": {"k": "v"},
    "store": False,
    "service_tier": "auto",
}


@pytest.mark.parametrize("field", list(CHANGING) + list(CHAT_ONLY))
def test_unsupported_fields_are_400s_naming_them(field):
    value = {**CHANGING, **CHAT_ONLY}[field]
    with pytest.raises(ValueError, match=f"^{field} is not supported"):
        chat_params(**{field: value})
    if field in CHANGING:
        with pytest.raises(ValueError, match=f"^{field} is not supported"):
            CompletionRequest(prompt="x", **{field: value}).to_sampling_params()


def test_no_op_values_are_accepted():
    chat_params(**NO_OPS)
    CompletionRequest(prompt="x", add_special_tokens=True, best_of=1).to_sampling_params()
    with pytest.raises(ValueError, match="add_special_tokens"):
        CompletionRequest(prompt="x", add_special_tokens=False).to_sampling_params()


def test_unknown_fields_warn_once_per_name(caplog):
    with caplog.at_level(logging.WARNING, logger="vlserve.api.request_fields"):
        chat_params(frobnicate_zz=1, other_unknown_zz=2)
        chat_params(frobnicate_zz=3)
        CompletionRequest(prompt="x", frobnicate_zz=1).to_sampling_params()
    warned = [r.getMessage() for r in caplog.records if r.name == "vlserve.api.request_fields"]
    assert sum("frobnicate_zz" in m for m in warned) == 1
    assert sum("other_unknown_zz" in m for m in warned) == 1


# -- over HTTP (needs the engine to enforce the constraint) -----------------------------------------------------------
def _chat(server, **kw):
    kw.setdefault("max_tokens", 200)
    kw.setdefault("temperature", 0)
    return server.client.chat.completions.create(model=server.model, messages=MSG, **kw)


def test_http_guided_choice(server):
    choices = ["circle", "square", "triangle"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        r = _chat(server, extra_body=extra)
        assert r.choices[0].message.content in choices
        assert r.choices[0].finish_reason == "stop"
    sampled = _chat(server, temperature=1.0, n=4, seed=3, extra_body={"guided_choice": choices})
    assert all(c.message.content in choices for c in sampled.choices)


def test_http_guided_regex_streamed_and_not(server):
    pattern = r"[a-z]{3}-[0-9]{2}"
    r = _chat(server, extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, r.choices[0].message.content)
    chunks = _chat(server, stream=True, extra_body={"guided_regex": pattern})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content


@pytest.mark.parametrize(
    "extra",
    [
        {
            "response_format": {"type": "json_schema", "json_schema": {"name": "scene", "schema": SCHEMA}},
            "structured_outputs": COMPACT,
        },
        {"guided_json": SCHEMA, "structured_outputs": COMPACT},
        {"structured_outputs": {"json": SCHEMA, **COMPACT}},
    ],
    ids=["response_format", "guided_json", "structured_outputs"],
)
def test_http_json_schema(server, extra):
    body = dict(extra)
    response_format = body.pop("response_format", None)
    kw = {"response_format": response_format} if response_format else {}
    r = _chat(server, extra_body=body, **kw)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_http_json_object(server):
    r = _chat(server, response_format={"type": "json_object"}, extra_body={"structured_outputs": COMPACT})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_http_completions(server):
    r = server.client.completions.create(
        model=server.model,
        prompt="The answer is",
        max_tokens=50,
        temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert r.choices[0].text in ("yes", "no")
    r = server.client.completions.create(
        model=server.model,
        prompt="The code is",
        max_tokens=50,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{4}"}},
    )
    assert re.fullmatch("[0-9]{4}", r.choices[0].text)


@pytest.mark.parametrize(
    "extra,words",
    [
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex and guided_choice"),
        ({"best_of": 3}, "best_of"),
        ({"use_beam_search": True, "guided_choice": ["a", "b"]}, "guided_choice"),  # beam search takes no constraint
        ({"prompt_logprobs": 99}, "prompt_logprobs"),
        ({"structured_outputs": {"regex": "a", "backend": "x"}}, "backend"),
        ({"guided_json": SCHEMA, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
        ({"guided_json": SCHEMA, "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        ({"guided_choice": []}, "guided_choice"),
    ],
)
def test_http_400s(server, extra, words):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server, max_tokens=2, extra_body=extra)
    assert words in str(e.value)


def test_http_unknown_field_is_accepted(server):
    r = _chat(server, max_tokens=2, extra_body={"some_new_field_zz": True})
    assert r.choices[0].message.content is not None


@pytest.mark.parametrize("extra", [{"guided_regex": "("}, {"guided_grammar": "root ::= undefined_rule"}])
def test_http_constraint_that_does_not_compile_is_a_400(server, extra):
    with pytest.raises(openai.BadRequestError):
        _chat(server, max_tokens=2, extra_body=extra)
