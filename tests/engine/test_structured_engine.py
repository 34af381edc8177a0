"""Structured outputs through the engine on the demo model (tiny random weights: its free text is noise, so every
valid output is the grammar's doing): JSON schema, choice, regex and grammar outputs valid for greedy and sampled
requests, n > 1, logprobs, chunked prefill, async scheduling, n-gram and EAGLE drafts, an image in the prompt; a
constraint cut by max_tokens ends "length"; a bad constraint is a ValueError before any compute; and the same on a
random model with a real 131k-token vocabulary."""

import json
import re

import jsonschema
import pytest
from PIL import Image

from tests.structured_output.conftest import big_tokenizer  # noqa: F401  (session fixture)
from vlserve import LLM, SamplingParams, StructuredOutputsParams
from vlserve.demo import default_model_path

SCHEMA = {
    "type": "object",
    "properties": {
        "shape": {"enum": ["circle", "square", "triangle"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "filled": {"type": "boolean"},
    },
    "required": ["shape", "count", "filled"],
    "additionalProperties": False,
}
CHOICES = ["red", "green", "blue", "yellow"]
REGEX = r"(cat|dog)-[0-9]{2,4}"
EBNF = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
PROMPTS = ["Describe the picture as JSON.", "What is it?", "Count the shapes please", "x"]


def _json(**kw):
    return SamplingParams(
        max_tokens=120, structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), **kw
    )


def _check_json(out):
    for c in out.outputs:
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMA)


@pytest.fixture(scope="module")
def llm():
    return LLM(default_model_path(), dtype="float32", num_kv_blocks=256, max_model_len=1024, seed=0)


def test_unconstrained_text_is_not_json(llm):
    """The premise: without the grammar the demo model's text is not valid output."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    for o in outs:
        with pytest.raises(ValueError):
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_greedy_and_sampled(llm, temperature):
    outs = llm.generate(PROMPTS, _json(temperature=temperature, seed=3), use_tqdm=False)
    for o in outs:
        _check_json(o)
    llm.check_integrity()


def test_n4_logprobs_and_chunked_prefill(llm):
    outs = llm.generate(PROMPTS * 2, _json(temperature=1.0, n=4, logprobs=2, seed=1), use_tqdm=False)
    for o in outs:
        assert len(o.outputs) == 4
        _check_json(o)
        for c in o.outputs:
            assert len(c.logprobs) == len(c.token_ids)
            for tok, entry in zip(c.token_ids, c.logprobs):
                assert entry[tok].logprob > float("-inf")  # the sampled token was allowed


def test_choice_regex_and_grammar(llm):
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=30, structured_outputs=StructuredOutputsParams(choice=CHOICES)
        )
        for i in range(4)
    ]
    params += [
        SamplingParams(temperature=1.0, seed=i, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=REGEX))
        for i in range(4)
    ]
    params += [
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(grammar=EBNF))
        for _ in range(4)
    ]
    outs = llm.generate(PROMPTS * 3, params, use_tqdm=False)
    for o in outs[:4]:
        assert o.outputs[0].text in CHOICES
    for o in outs[4:8]:
        assert re.fullmatch(REGEX, o.outputs[0].text), o.outputs[0].text
    for o in outs[8:]:
        text = o.outputs[0].text
        assert re.fullmatch(r"\([0-9](\+[0-9])*\)", text) or o.outputs[0].finish_reason == "length", text
    llm.check_integrity()


def test_cut_by_max_tokens_ends_length(llm):
    out = llm.generate(
        ["a"],
        SamplingParams(
            max_tokens=3,
            temperature=0.0,
            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith("{")


def test_mixed_batch_leaves_unconstrained_requests_alone(llm):
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    mixed = llm.generate(PROMPTS * 2, [free] * 4 + [_json(temperature=0.0)] * 4, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    for o in mixed[4:]:
        _check_json(o)


def test_image_in_prompt(llm):
    img = Image.new("RGB", (64, 64), (200, 30, 30))
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": img},
                {"type": "text", "text": "Describe the shape as JSON."},
            ],
        }
    ]
    outs = llm.chat([msgs, msgs], [_json(temperature=0.0), _json(temperature=1.0, seed=5)], use_tqdm=False)
    for o in outs:
        _check_json(o)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"async_scheduling": True},
        {"max_num_batched_tokens": 8},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}},
        {"speculative_config": {"method": "eagle", "num_speculative_tokens": 3}},
    ],
    ids=["async", "chunked", "ngram", "eagle"],
)
def test_engine_modes_give_the_same_constrained_output(llm, engine_kwargs):
    params = [
        _json(temperature=0.0),
        SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=REGEX)),
        _json(temperature=0.0),
    ]
    prompts = PROMPTS[:3]
    base = llm.generate(prompts, params, use_tqdm=False)
    other = LLM(default_model_path(), dtype="float32", num_kv_blocks=256, max_model_len=1024, seed=0, **engine_kwargs)
    got = other.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in base]
    _check_json(got[0])
    assert re.fullmatch(REGEX, got[1].outputs[0].text)
    other.check_integrity()


@pytest.mark.parametrize(
    "constraint,needle",
    [
        (dict(json={"type": "strin"}), "strin"),
        (dict(regex="(abc"), "parenthesis"),
        (dict(grammar='root ::= "a" | '), "EBNF"),
    ],
)
def test_bad_constraint_is_a_value_error(llm, constraint, needle):
    with pytest.raises(ValueError, match=needle):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)), use_tqdm=False)
    llm.check_integrity()


def test_params_refuse_two_constraints_and_empty_choice():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="non-empty"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="unsupported field"):
        SamplingParams(structured_outputs={"json": SCHEMA, "whitespace": "x"})


TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)


def test_llm_chat_passes_tools_to_the_template(llm):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "count_shapes",
                "description": "Count the shapes",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    msgs = [{"role": "user", "content": "How many shapes are there?"}]
    kw = {"chat_template": TOOLS_TEMPLATE}
    tok = llm.input_processor.tokenizer
    expected = tok.apply_chat_template(msgs, tools=tools, chat_template=TOOLS_TEMPLATE, tokenize=False)
    assert "<tools>count_shapes;</tools>" in expected
    out = llm.chat(msgs, SamplingParams(max_tokens=1), use_tqdm=False, tools=tools, chat_template_kwargs=kw)[0]
    base = llm.chat(msgs, SamplingParams(max_tokens=1), use_tqdm=False, chat_template_kwargs=kw)[0]
    assert out.prompt_token_ids == tok(expected, add_special_tokens=False)["input_ids"]
    assert len(out.prompt_token_ids) > len(base.prompt_token_ids)
    with pytest.raises(ValueError, match="tools"):
        llm.chat(msgs, SamplingParams(max_tokens=1), use_tqdm=False, tools="count_shapes")


def test_real_size_vocabulary(big_tokenizer, tmp_path):
    """A random model with a real 131k-token vocabulary (4,096 bitmask words a row; hundreds of whitespace and
    long tokens): sampled JSON, choice and regex outputs are valid, and the batch's mixed rows (constrained next to
    free) leave the free request's output equal to its run alone."""
    from vlserve.demo.checkpoints import build_text_checkpoint

    tok_dir = tmp_path / "tokenizer"
    big_tokenizer.save_pretrained(tok_dir)
    model = build_text_checkpoint(str(tmp_path / "model"), hidden_size=64, num_layers=1, tokenizer_dir=str(tok_dir))
    llm = LLM(model, dtype="float32", num_kv_blocks=128, max_model_len=512, seed=0)
    prompts = ["Describe the picture as JSON.", "What is it?", "Count the shapes please", "x"]
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompts[:1], free, use_tqdm=False)[0].outputs[0].token_ids
    params = [
        free,
        _json(temperature=1.0, seed=5),
        SamplingParams(
            temperature=1.0, seed=6, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=CHOICES)
        ),
        SamplingParams(temperature=1.0, seed=7, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=REGEX)),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone
    _check_json(outs[1])
    assert outs[2].outputs[0].text in CHOICES
    assert re.fullmatch(REGEX, outs[3].outputs[0].text), outs[3].outputs[0].text
    llm.check_integrity()
