"""Reasoning over HTTP with the openai client, on a tiny Qwen3 checkpoint whose tokenizer has `<think>` /
`</think>` and whose chat template opens `<think>` (or closes an empty one with enable_thinking false), served
with --reasoning-parser qwen3.

Random weights never close their reasoning on their own, so `thinking_token_budget` is what ends it here: the
engine forces `</think>` after that many tokens; the reasoning is then the greedy text a budget-free request
reasons, and the rest is content (or, with a constraint, text of the grammar, which starts only after the tag)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.api.conftest import TEXT_ENGINE_KW, start_server

ASK = [{"role": "user", "content": "hello"}]
CHOICES = ["alpha", "beta", "gamma"]


@pytest.fixture(scope="module")
def thinking_ckpt(tmp_path_factory) -> str:
    from vlserve.demo.checkpoints import build_text_checkpoint

    return build_text_checkpoint(str(tmp_path_factory.mktemp("thinking")), arch="qwen3", thinking=True)


@pytest.fixture(scope="module")
def reasoning_server(thinking_ckpt):
    from vlserve.config import EngineArgs

    served = start_server(
        EngineArgs(model=thinking_ckpt, served_model_name="tiny-thinking", reasoning_parser="qwen3", **TEXT_ENGINE_KW)
    )
    yield served
    served.close()


def create(served, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("messages", ASK)
    return served.client.chat.completions.create(model=served.model, **kw)


def free_reasoning(served, num_tokens: int) -> str:
    """What the model reasons in `num_tokens` greedy tokens when nothing ends its reasoning."""
    r = create(served, max_tokens=num_tokens, extra_body={"ignore_eos": True})
    message = r.choices[0].message
    assert message.content is None and r.usage.completion_tokens == num_tokens
    return message.reasoning


def test_budget_forces_the_end_of_reasoning(reasoning_server):
    expected = free_reasoning(reasoning_server, 4)
    assert expected
    r = create(
        reasoning_server, max_tokens=12, logprobs=True, extra_body={"thinking_token_budget": 4, "ignore_eos": True}
    )
    message = r.choices[0].message
    tokens = [t.token for t in r.choices[0].logprobs.content]
    assert tokens[4] == "</think>" and "</think>" not in tokens[:4]
    assert message.reasoning == message.reasoning_content == expected
    assert message.content and "</think>" not in message.content
    assert r.usage.completion_tokens == 12  # max_tokens counts reasoning and content
    assert r.usage.completion_tokens_details.reasoning_tokens == 4  # the tags not counted


def test_responses_give_a_reasoning_item(reasoning_server):
    expected = free_reasoning(reasoning_server, 5)
    r = reasoning_server.client.responses.create(
        model=reasoning_server.model, input="hello", temperature=0, max_output_tokens=5
    )
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == expected
    assert r.usage.output_tokens == 5 and r.usage.output_tokens_details.reasoning_tokens == 5
    with reasoning_server.client.responses.stream(
        model=reasoning_server.model, input="hello", temperature=0, max_output_tokens=5
    ) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"  # the length ran out inside the reasoning
    final = events[-1].response
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == expected


def test_streaming_splits_the_same(reasoning_server):
    kw = dict(max_tokens=10, extra_body={"thinking_token_budget": 3, "ignore_eos": True})
    whole = create(reasoning_server, **kw).choices[0].message
    reasoning, reasoning_content, content = [], [], []
    for chunk in create(reasoning_server, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning.append(getattr(delta, "reasoning", None) or "")
            reasoning_content.append(getattr(delta, "reasoning_content", None) or "")
            content.append(delta.content or "")
    assert "".join(reasoning) == "".join(reasoning_content) == whole.reasoning
    assert "".join(content) == whole.content


def test_include_reasoning_false_leaves_it_out(reasoning_server):
    body = {
        "model": reasoning_server.model,
        "messages": ASK,
        "max_tokens": 8,
        "temperature": 0,
        "thinking_token_budget": 2,
        "ignore_eos": True,
    }
    shown = reasoning_server.http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    hidden = reasoning_server.http.post("/v1/chat/completions", json={**body, "include_reasoning": False}).json()[
        "choices"
    ][0]["message"]
    assert shown["reasoning"] and shown["reasoning_content"] == shown["reasoning"]
    assert "reasoning" not in hidden and "reasoning_content" not in hidden
    assert hidden["content"] == shown["content"]


def test_the_grammar_starts_after_the_reasoning(reasoning_server):
    expected = free_reasoning(reasoning_server, 3)
    r = create(
        reasoning_server,
        max_tokens=40,
        extra_body={"thinking_token_budget": 3, "structured_outputs": {"choice": CHOICES}},
    )
    message = r.choices[0].message
    assert message.reasoning == expected  # the reasoning was free: the greedy text of an unconstrained request
    assert message.content in CHOICES and r.choices[0].finish_reason == "stop"


def test_json_schema_content_after_reasoning(reasoning_server):
    schema = {"type": "object", "properties": {"pick": {"enum": CHOICES}}, "required": ["pick"]}
    constraint = {"json": schema, "disable_any_whitespace": True}
    r = create(
        reasoning_server, max_tokens=60, extra_body={"thinking_token_budget": 2, "structured_outputs": constraint}
    )
    message = r.choices[0].message
    assert message.reasoning == free_reasoning(reasoning_server, 2)
    assert json.loads(message.content)["pick"] in CHOICES and r.choices[0].finish_reason == "stop"


def test_enable_thinking_false_is_all_content(reasoning_server):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    plain = create(reasoning_server, max_tokens=6, extra_body={**off, "ignore_eos": True})
    assert plain.choices[0].message.content and getattr(plain.choices[0].message, "reasoning", None) is None
    constrained = create(reasoning_server, max_tokens=20, extra_body={**off, "structured_outputs": {"choice": CHOICES}})
    message = constrained.choices[0].message
    assert message.content in CHOICES and getattr(message, "reasoning", None) is None
    # thinking on (the template opens <think>): six free tokens are all reasoning
    on = create(reasoning_server, max_tokens=6, extra_body={"ignore_eos": True})
    assert on.choices[0].message.content is None and on.choices[0].message.reasoning


def test_bad_budgets_are_400(reasoning_server, server):
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        create(reasoning_server, max_tokens=4, extra_body={"thinking_token_budget": -1})
    with pytest.raises(openai.BadRequestError, match="--reasoning-parser"):
        create(server, max_tokens=4, extra_body={"thinking_token_budget": 4})
    with pytest.raises(openai.BadRequestError, match="include_reasoning"):
        server.client.completions.create(
            model=server.model, prompt="hi", max_tokens=2, extra_body={"include_reasoning": False}
        )


def test_tool_calls_are_read_from_the_content_only():
    from tests.api.test_tool_calls import TOOLS
    from vlserve.api.reasoning_output import ReasoningOutput
    from vlserve.api.serving_chat import _message
    from vlserve.api.tool_choice import plan_tools
    from vlserve.api.tool_parsers import ToolParserManager
    from vlserve.reasoning import get_reasoning_parser

    plan = plan_tools(TOOLS, "auto", None, ToolParserManager.get("hermes"))
    thought = 'maybe <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>?'
    text = f'<think>{thought}</think><tool_call>{{"name": "get_time", "arguments": {{}}}}</tool_call>'
    message, finish_reason = _message(plan, text, "stop", ReasoningOutput(get_reasoning_parser("qwen3")(), []))
    assert message.reasoning == message.reasoning_content == thought
    assert [c.function.name for c in message.tool_calls] == ["get_time"] and finish_reason == "tool_calls"
    hidden, _ = _message(plan, text, "stop", ReasoningOutput(get_reasoning_parser("qwen3")(), [], include=False))
    assert hidden.reasoning is None and [c.function.name for c in hidden.tool_calls] == ["get_time"]


def test_beam_search_splits_reasoning_too(reasoning_server):
    r = create(reasoning_server, n=2, max_tokens=3, extra_body={"use_beam_search": True, "ignore_eos": True})
    for choice in r.choices:  # the template opened <think> and nothing closed it: all reasoning
        assert choice.message.content is None and choice.message.reasoning
    with pytest.raises(openai.BadRequestError, match="beam search"):
        create(reasoning_server, max_tokens=3, extra_body={"use_beam_search": True, "thinking_token_budget": 1})


@pytest.mark.slow
def test_serve_flag_with_the_engine_process(thinking_ckpt, repo_root, reasoning_server):
    """`vlserve serve --reasoning-parser qwen3` (engine core in its own process) answers as the in-process server."""
    from tests.api.conftest import serve_subprocess

    kw = dict(max_tokens=8, extra_body={"thinking_token_budget": 3, "ignore_eos": True})
    expected = create(reasoning_server, **kw).choices[0].message
    args = [thinking_ckpt, "--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "64"]
    args += ["--served-model-name", "tiny-thinking", "--reasoning-parser", "qwen3", "--log-level", "warning"]
    with serve_subprocess(args, repo_root) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        message = client.chat.completions.create(model="tiny-thinking", messages=ASK, temperature=0, **kw)
        assert message.choices[0].message.reasoning == expected.reasoning
        assert message.choices[0].message.content == expected.content
