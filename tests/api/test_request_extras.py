"""vLLM's request extras over HTTP with the openai client (extra_body): truncate_prompt_tokens, cache_salt,
priority, return_token_ids, echo, add_generation_prompt / continue_final_message / add_special_tokens; greedy
outputs against HF where a field changes the prompt; bad values are 400s and the server lives on."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.api.conftest import TEXT_ENGINE_KW
from vlserve import SamplingParams

GREEDY = {"temperature": 0, "max_tokens": 6}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer(text_ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(text_ckpt)


@pytest.fixture(scope="module")
def hf_greedy(text_ckpt):
    """HF's greedy continuation (EOS ignored) of token-id prompts: {tuple(prompt): tokens}, one model load."""
    from tests.support.hf_generate import hf_greedy_continuations

    def run(prompts: list[list[int]], n: int) -> list[list[int]]:
        return hf_greedy_continuations(text_ckpt, prompts, n)

    return run


def _chat(server, messages, **extra):
    return server.client.chat.completions.create(
        model=server.model, messages=messages, **GREEDY, extra_body={**NO_EOS, **extra}
    )


def _complete(server, prompt, **extra):
    return server.client.completions.create(model=server.model, prompt=prompt, **GREEDY, extra_body={**NO_EOS, **extra})


def _assert_400(call, *words):
    with pytest.raises(openai.BadRequestError) as e:
        call()
    message = str(e.value)
    for w in words:
        assert w in message, message


def _alive(server):
    r = _complete(server, "still here?")
    assert r.choices[0].finish_reason == "length"


# -- truncate_prompt_tokens --------------------------------------------------------------------------------------------
def test_truncate_prompt_tokens_keeps_the_last_k_tokens_and_matches_hf(server, hf_greedy):
    ids = [(37 * i) % 500 + 20 for i in range(40)]
    r = _complete(server, ids, truncate_prompt_tokens=8, return_token_ids=True)
    choice = r.choices[0].model_dump()
    assert choice["prompt_token_ids"] == ids[-8:] and r.usage.prompt_tokens == 8
    assert choice["token_ids"] == hf_greedy([ids[-8:]], 6)[0]
    untouched = _complete(server, ids[:5], truncate_prompt_tokens=8, return_token_ids=True).choices[0].model_dump()
    assert untouched["prompt_token_ids"] == ids[:5]


def test_truncate_prompt_tokens_on_chat_matches_hf(server, hf_greedy):
    messages = [{"role": "user", "content": "Tell me about the red circle and the blue square, please."}]
    full = _chat(server, messages, return_token_ids=True).model_dump()["prompt_token_ids"]
    r = _chat(server, messages, truncate_prompt_tokens=12, return_token_ids=True).model_dump()
    assert len(full) > 12 and r["prompt_token_ids"] == full[-12:]
    assert r["choices"][0]["token_ids"] == hf_greedy([full[-12:]], 6)[0]


def test_truncate_prompt_tokens_bad_values_are_400s(server):
    _assert_400(lambda: _complete(server, "hi", truncate_prompt_tokens=4096), "truncate_prompt_tokens", "max_model_len")
    _assert_400(lambda: _complete(server, "hi", truncate_prompt_tokens=0), "truncate_prompt_tokens")
    _assert_400(lambda: _chat(server, [{"role": "user", "content": "x"}], truncate_prompt_tokens=-2), "truncate")
    r = _complete(server, "a short prompt", truncate_prompt_tokens=-1)  # -1: max_model_len, nothing to cut here
    assert r.usage.prompt_tokens > 1
    _alive(server)


# -- cache_salt ------------------------------------------------------------------------------------------------------
def test_cache_salt_isolates_prefix_cache_between_tenants(server):
    prompt = f"{uuid.uuid4().hex} " + "the quick brown fox jumps over the lazy dog " * 6

    def cached(**extra) -> int:
        return _complete(server, prompt, **extra).usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0  # same prompt, other salt: nothing shared
    assert cached() == 0  # unsalted: nothing shared either
    assert cached(cache_salt="tenant-a") >= 16  # same salt: its blocks are hits
    _assert_400(lambda: _complete(server, prompt, cache_salt=""), "cache_salt")
    with pytest.raises(openai.BadRequestError):
        _complete(server, prompt, cache_salt=5)
    _alive(server)


# -- priority ----------------------------------------------------------------------------------------------------------
def test_priority_under_fcfs_is_a_400(server):
    _assert_400(lambda: _complete(server, "hi", priority=3), "priority")
    _assert_400(lambda: _chat(server, [{"role": "user", "content": "x"}], priority=-1), "priority")
    assert _complete(server, "hi", priority=0).choices[0].finish_reason == "length"
    _alive(server)


@pytest.fixture(scope="module")
def priority_server(text_ckpt):
    """The engine in its own process (the fields cross the process boundary), scheduling by priority."""
    from tests.api.test_engine_process import start_proc_server
    from vlserve.config import EngineArgs

    served = start_proc_server(
        EngineArgs(model=text_ckpt, served_model_name="tiny-prio", scheduling_policy="priority", **TEXT_ENGINE_KW)
    )
    yield served
    served.close()


def test_priority_policy_in_the_engine_process(priority_server):
    plain = _complete(priority_server, "What color is the circle?").choices[0].text
    for priority in (-5, 0, 7):
        r = _complete(priority_server, "What color is the circle?", priority=priority)
        assert r.choices[0].text == plain
    chat = _chat(priority_server, [{"role": "user", "content": "hello"}], priority=2)
    assert chat.choices[0].finish_reason == "length"
    prompt = f"{uuid.uuid4().hex} " + "a salted prompt for the engine process " * 6
    salted = [
        _complete(priority_server, prompt, cache_salt=salt).usage.prompt_tokens_details.cached_tokens
        for salt in ("x", "y", "x")
    ]
    assert salted[0] == 0 and salted[1] == 0 and salted[2] >= 16
    r = _complete(priority_server, list(range(40, 80)), truncate_prompt_tokens=9, return_token_ids=True)
    assert r.choices[0].model_dump()["prompt_token_ids"] == list(range(71, 80))
    assert priority_server.wait_idle()["vlserve:num_requests_running"] == 0


# -- return_token_ids --------------------------------------------------------------------------------------------------
def test_return_token_ids_chat_streamed_equals_nonstreamed(server, tokenizer):
    messages = [{"role": "user", "content": "Count the shapes."}]
    r = _chat(server, messages, return_token_ids=True).model_dump()
    prompt_ids, token_ids = r["prompt_token_ids"], r["choices"][0]["token_ids"]
    assert len(token_ids) == 6 and r["usage"]["prompt_tokens"] == len(prompt_ids)
    # (a token that ends inside a character decodes to U+FFFD; the text holds that character back)
    assert tokenizer.decode(token_ids).rstrip("\ufffd") == r["choices"][0]["message"]["content"].rstrip("\ufffd")
    chunks = [
        c.model_dump()
        for c in server.client.chat.completions.create(
            model=server.model,
            messages=messages,
            stream=True,
            **GREEDY,
            extra_body={**NO_EOS, "return_token_ids": True},
        )
    ]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c or c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []] == token_ids
    plain = _chat(server, messages).model_dump()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_return_token_ids_completions_streamed_with_n(server):
    body = {"model": server.model, "prompt": ["one two", "three"], "n": 2, "temperature": 0, "max_tokens": 5}
    extra = {**NO_EOS, "return_token_ids": True}
    r = server.client.completions.create(**body, extra_body=extra).model_dump()
    assert len(r["choices"]) == 4
    streamed: dict[int, dict] = {}
    for c in server.client.completions.create(**body, stream=True, extra_body=extra):
        for ch in c.model_dump()["choices"]:
            s = streamed.setdefault(ch["index"], {"prompt": [], "tokens": []})
            s["prompt"].append(ch.get("prompt_token_ids"))
            s["tokens"] += ch.get("token_ids") or []
    for choice in r["choices"]:
        s = streamed[choice["index"]]
        assert s["prompt"][0] == choice["prompt_token_ids"] and not any(s["prompt"][1:])
        assert s["tokens"] == choice["token_ids"] and len(choice["token_ids"]) == 5


# -- echo --------------------------------------------------------------------------------------------------------------
def test_completion_echo_puts_the_prompt_first(server, tokenizer):
    plain = _complete(server, "The circle is").choices[0].text
    r = _complete(server, "The circle is", echo=True)
    assert r.choices[0].text == "The circle is" + plain
    streamed = "".join(
        ch.text
        for c in server.client.completions.create(
            model=server.model, prompt="The circle is", stream=True, echo=True, **GREEDY, extra_body=NO_EOS
        )
        for ch in c.choices
    )
    assert streamed == r.choices[0].text
    ids = tokenizer("The square is", add_special_tokens=False)["input_ids"]
    assert _complete(server, ids, echo=True).choices[0].text.startswith(tokenizer.decode(ids))
    _assert_400(lambda: _complete(server, "x", echo=True, logprobs=1), "echo")


def test_chat_echo_continues_an_assistant_message(server, tokenizer, hf_greedy):
    partial = "The red circle is"
    messages = [{"role": "user", "content": "Describe the circle."}, {"role": "assistant", "content": partial}]
    extra = {"add_generation_prompt": False, "continue_final_message": True, "return_token_ids": True}
    r = _chat(server, messages, echo=True, **extra).model_dump()
    message = r["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].startswith(partial)
    hf_text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    hf_ids = tokenizer(hf_text, add_special_tokens=False)["input_ids"]
    assert hf_text.rstrip().endswith(partial) and r["prompt_token_ids"] == hf_ids
    assert r["choices"][0]["token_ids"] == hf_greedy([hf_ids], 6)[0]
    assert message["content"] == partial + _chat(server, messages, **extra).choices[0].message.content
    streamed = "".join(
        ch.delta.content or ""
        for c in server.client.chat.completions.create(
            model=server.model, messages=messages, stream=True, **GREEDY, extra_body={**NO_EOS, **extra, "echo": True}
        )
        for ch in c.choices
    )
    assert streamed == message["content"]
    no_echo = _chat(server, [{"role": "user", "content": "hi"}], echo=True).choices[0].message.content
    assert no_echo == _chat(server, [{"role": "user", "content": "hi"}]).choices[0].message.content  # roles differ


# -- chat template options ---------------------------------------------------------------------------------------------
def test_add_generation_prompt_false_renders_as_hf_and_takes_the_last_role(server, tokenizer):
    messages = [{"role": "user", "content": "Just the conversation."}]
    r = _chat(server, messages, add_generation_prompt=False, return_token_ids=True).model_dump()
    hf_ids = tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False), add_special_tokens=False
    )["input_ids"]
    with_prompt = _chat(server, messages, return_token_ids=True).model_dump()["prompt_token_ids"]
    assert r["prompt_token_ids"] == hf_ids and with_prompt != hf_ids
    assert r["choices"][0]["message"]["role"] == "user"  # vLLM: the reply takes the last message's role


def test_chat_template_option_conflicts_are_400s(server):
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    _assert_400(lambda: _chat(server, messages, continue_final_message=True), "continue_final_message")
    _assert_400(lambda: _chat(server, messages, add_generation_prompt="maybe"), "add_generation_prompt")
    _alive(server)


def test_add_special_tokens_on_chat_tokenizes_with_them(server, tokenizer):
    messages = [{"role": "user", "content": "special"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    r = _chat(server, messages, add_special_tokens=True, return_token_ids=True).model_dump()
    assert r["prompt_token_ids"] == tokenizer(text, add_special_tokens=True)["input_ids"]


def test_beam_search_refuses_the_extras(server):
    _assert_400(lambda: _complete(server, "hi", use_beam_search=True, cache_salt="s"), "cache_salt")
    _alive(server)


# -- the Python API ----------------------------------------------------------------------------------------------------
def test_offline_llm_truncates_and_refuses_priority_under_fcfs(offline_llm):
    ids = list(range(30, 60))
    out = offline_llm.generate(
        [ids], SamplingParams(temperature=0, max_tokens=3, truncate_prompt_tokens=7), use_tqdm=False
    )[0]
    assert out.prompt_token_ids == ids[-7:]
    ref = offline_llm.generate([ids[-7:]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    with pytest.raises(ValueError, match="priority"):
        offline_llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[1])
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match="cannot both be true"):
        offline_llm.chat([{"role": "user", "content": "x"}], continue_final_message=True)


def test_offline_llm_takes_cache_salt_in_the_prompt_dict(offline_llm):
    ids = [300 + (i * 7) % 200 for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=2)

    def cached(**salt) -> int:
        return offline_llm.generate([{"prompt_token_ids": ids, **salt}], params, use_tqdm=False)[0].num_cached_tokens

    assert cached(cache_salt="one") == 0
    assert cached(cache_salt="two") == 0
    assert cached(cache_salt="one") >= 32
    with pytest.raises(ValueError, match="cache_salt"):
        cached(cache_salt="")


def test_truncation_refuses_to_cut_a_media_prompt_but_keeps_a_short_one(offline_llm):
    from vlserve.engine.input_processor import ProcessedPrompt
    from vlserve.multimodal.inputs import MultiModalFeature

    proc = offline_llm.input_processor
    media = ProcessedPrompt(None, list(range(10, 30)), [MultiModalFeature("image", "h", 12, 4)])
    with pytest.raises(ValueError, match="media"):
        proc.truncate_prompt(media, 8)
    assert proc.truncate_prompt(media, 20) is media and proc.truncate_prompt(media, None) is media
    text = proc.process_prompt("one two three four five six seven")
    cut = proc.truncate_prompt(text, 3)
    assert cut.prompt_token_ids == text.prompt_token_ids[-3:] and cut.prompt == proc.tokenizer.decode(
        cut.prompt_token_ids
    )
