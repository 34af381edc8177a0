"""`use_beam_search` over HTTP (the openai client's extra_body): completions and chat (an image part too) return what
the offline `LLM.beam_search` returns, best first, as HF's `generate(num_beams=...)` ranks them when EOS is ignored;
the fields beam search does not take are 400s naming them; a client that hangs up leaves no request or KV block."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.api.test_api_media import data_url, image_msg, png_bytes
from vlserve import BeamSearchParams

BEAM = {"use_beam_search": True}
# Picked so that beams end in EOS (<|im_end|>) within 16 tokens on the tiny checkpoint: two of four do here.
EOS_PROMPT = "small the small is where left the right"
OTHER_PROMPT = "what circle color where what right"
CHAT = [{"role": "user", "content": "where is the blue dog on the left?"}]


def expected(llm, prompt, n, max_tokens, include_eos=False, **kw):
    """(texts, finish reasons, completion tokens) of the offline beam search, best first, as the server returns."""
    out = llm.beam_search(prompt, BeamSearchParams(beam_width=n, max_tokens=max_tokens, **kw))[0].sequences
    texts = [
        llm.tokenizer.decode(s.output_tokens[:-1] if s.finished else s.output_tokens, skip_special_tokens=True)
        for s in out
    ]
    reasons = ["stop" if s.finished else "length" for s in out]
    tokens = sum(len(s.output_tokens) - (s.finished and not include_eos) for s in out)
    return texts, reasons, tokens


def complete(server, prompt, **kw):
    return server.client.completions.create(
        model=server.model, prompt=prompt, temperature=0, extra_body={**BEAM, **kw.pop("extra", {})}, **kw
    )


@pytest.mark.parametrize("n", [2, 4])
def test_completions_equal_offline_beam_search(server, offline_llm, n):
    texts, reasons, tokens = expected(offline_llm, EOS_PROMPT, n, 16)
    r = complete(server, EOS_PROMPT, n=n, max_tokens=16)
    assert [c.index for c in r.choices] == list(range(n))
    assert [c.text for c in r.choices] == texts
    assert [c.finish_reason for c in r.choices] == reasons
    if n == 4:
        assert "stop" in reasons and "length" in reasons  # both kinds of ending are exercised
    prompt_len = len(offline_llm.tokenizer(EOS_PROMPT).input_ids)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_len, tokens)
    assert r.usage.total_tokens == prompt_len + tokens
    server.wait_idle()
    server.engine.engine.check_integrity()


def test_several_prompts_and_include_stop_str(server, offline_llm):
    r = complete(server, [EOS_PROMPT, OTHER_PROMPT], n=4, max_tokens=16, extra={"include_stop_str_in_output": True})
    want = [expected(offline_llm, p, 4, 16, include_eos=True) for p in (EOS_PROMPT, OTHER_PROMPT)]
    assert [c.index for c in r.choices] == list(range(8))
    assert [c.text for c in r.choices] == want[0][0] + want[1][0]  # the EOS is never in the text
    assert [c.finish_reason for c in r.choices] == want[0][1] + want[1][1]
    assert r.usage.completion_tokens == want[0][2] + want[1][2]  # ... but counts with include_stop_str_in_output


@pytest.mark.parametrize(
    "n,extra", [(4, {"ignore_eos": True}), (4, {"length_penalty": 2.0}), (6, {"early_stopping": True})]
)
def test_ignore_eos_length_penalty_and_early_stopping(server, offline_llm, n, extra):
    """Each setting reaches the search: the beams differ from the default ones and equal the offline search's."""
    texts, reasons, tokens = expected(offline_llm, OTHER_PROMPT, n, 16, **extra)
    assert (texts, reasons) != expected(offline_llm, OTHER_PROMPT, n, 16)[:2]
    r = complete(server, OTHER_PROMPT, n=n, max_tokens=16, extra=extra)
    assert [c.text for c in r.choices] == texts
    assert [c.finish_reason for c in r.choices] == reasons
    assert r.usage.completion_tokens == tokens


@pytest.mark.parametrize("n", [2, 4])
def test_completions_equal_hf_num_beams(server, text_ckpt, n):
    """With EOS ignored every beam runs max_tokens long, where HF's beam search and vLLM's pick the same beams."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(text_ckpt)
    model = AutoModelForCausalLM.from_pretrained(text_ckpt, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as tests.support.hf_generate does
    ids = torch.tensor([tok(OTHER_PROMPT).input_ids])
    cfg = GenerationConfig(
        max_new_tokens=10,
        do_sample=False,
        num_beams=n,
        num_return_sequences=n,
        eos_token_id=None,
        pad_token_id=0,
        length_penalty=1.0,
    )
    with torch.no_grad():
        hf = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    want = [tok.decode(seq[ids.shape[1] :], skip_special_tokens=True) for seq in hf]
    r = complete(server, OTHER_PROMPT, n=n, max_tokens=10, extra={"ignore_eos": True})
    assert [c.text for c in r.choices] == want


def test_chat_equals_offline_beam_search(server, offline_llm):
    texts, reasons, tokens = expected(offline_llm, CHAT, 3, 12)
    r = server.client.chat.completions.create(
        model=server.model, messages=CHAT, n=3, max_completion_tokens=12, extra_body=BEAM
    )
    assert [c.message.content for c in r.choices] == texts
    assert [c.finish_reason for c in r.choices] == reasons
    assert [c.message.role for c in r.choices] == ["assistant"] * 3
    assert r.usage.completion_tokens == tokens
    assert r.object == "chat.completion"


# -- an image part ------------------------------------------------------------------------------------------------
VLM_KW = dict(dtype="float32", max_model_len=1024, num_kv_blocks=128, block_size=16, max_num_seqs=16)


@pytest.fixture(scope="module")
def llava_ckpt(tmp_path_factory) -> str:
    from vlserve.demo.llava_checkpoints import build_llava_checkpoint

    return build_llava_checkpoint(str(tmp_path_factory.mktemp("beam_llava")))


def test_chat_with_image_equals_offline(llava_ckpt):
    from tests.api.conftest import start_server
    from vlserve import LLM
    from vlserve.config import EngineArgs

    messages = image_msg(data_url(png_bytes(3, size=(64, 48))), text="what is in the picture?")
    offline = LLM(llava_ckpt, **VLM_KW)
    texts, reasons, tokens = expected(offline, messages, 3, 10)
    prompt_len = len(offline.input_processor.process_chat(messages).prompt_token_ids)
    served = start_server(EngineArgs(model=llava_ckpt, served_model_name="tiny-llava", **VLM_KW))
    try:
        r = served.client.chat.completions.create(
            model=served.model, messages=messages, n=3, max_tokens=10, extra_body=BEAM
        )
        assert [c.message.content for c in r.choices] == texts
        assert [c.finish_reason for c in r.choices] == reasons
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_len, tokens)
        served.wait_idle()
        served.engine.engine.check_integrity()  # the beams' encoder cache references are all released
    finally:
        served.close()


# -- refusals -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body,param,words",
    [
        ({**BEAM, "stream": True}, "stream", "does not stream"),
        ({**BEAM, "temperature": 0.7}, "temperature", "temperature must be 0"),
        ({**BEAM, "n": 33}, "n", "[1, 32]"),
        ({**BEAM, "n": 0}, "n", "[1, 32]"),
        ({"length_penalty": 0.5}, None, "length_penalty is not supported"),
        ({"early_stopping": True}, None, "use_beam_search=true"),
        ({**BEAM, "stop": ["x"]}, "stop", "stop is not supported with use_beam_search"),
        ({**BEAM, "logprobs": 2}, "logprobs", "logprobs"),
        ({**BEAM, "top_p": 0.9}, "top_p", "top_p"),
        ({**BEAM, "presence_penalty": 0.5}, "presence_penalty", "presence_penalty"),
        ({**BEAM, "seed": 3}, "seed", "seed"),
        ({**BEAM, "min_tokens": 2}, "min_tokens", "min_tokens"),
        ({**BEAM, "guided_choice": ["a", "b"]}, "guided_choice", "guided_choice"),
        ({**BEAM, "response_format": {"type": "json_object"}}, "response_format", "response_format"),
        ({**BEAM, "echo": True}, "echo", "echo"),
        ({**BEAM, "logit_bias": {"5": 3}}, "logit_bias", "logit_bias is not supported with use_beam_search"),
        ({**BEAM, "max_tokens": 2000}, "max_tokens", "too large"),
        ({"use_beam_search": "yes"}, "use_beam_search", "boolean"),
        ({**BEAM, "length_penalty": "long"}, "length_penalty", "number"),
    ],
)
def test_completion_400s(server, body, param, words):
    r = server.http.post("/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"] == param and err["type"] == "BadRequestError"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"stream": True}, "stream"),
        ({"temperature": 1.0}, "temperature"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2, "logprobs": True}, "logprobs"),
        ({"frequency_penalty": 1.0}, "frequency_penalty"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_chat_400s(server, body, param):
    r = server.http.post("/v1/chat/completions", json={"model": server.model, "messages": CHAT, **BEAM, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_openai_client_sees_bad_request(server):
    with pytest.raises(openai.BadRequestError, match="does not stream"):
        complete(server, "hi", n=2, max_tokens=4, stream=True)
    # the defaults beam search ignores are fine: temperature 0, top_p 1, penalties 0, no stop
    r = complete(
        server,
        "hi",
        n=2,
        max_tokens=4,
        top_p=1.0,
        presence_penalty=0.0,
        stop=[],
        extra={"length_penalty": 1.0, "early_stopping": False, "use_beam_search": True},
    )
    assert len(r.choices) == 2


# -- hanging up ---------------------------------------------------------------------------------------------------
def _aborted(server) -> float:
    return server.metrics()["vlserve:num_aborted_requests_total"]


def _finished(server) -> float:
    """Engine requests finished so far, whatever the reason (abort included)."""
    return sum(v for k, v in server.metrics_labelled().items() if k.startswith("vlserve:request_success_total"))


def test_disconnect_stops_the_search(server):
    before = _finished(server)
    body = {"model": server.model, "prompt": EOS_PROMPT, "n": 4, "max_tokens": 900, "ignore_eos": True, **BEAM}
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(60, read=0.5), trust_env=False) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json=body)
    done, deadline = _finished(server), time.monotonic() + 10
    assert done > before  # the search ran some steps ...
    while True:  # ... and submits no more once the server has seen the client go (900 steps take far longer)
        time.sleep(0.5)
        now = _finished(server)
        if now == done:
            break
        assert time.monotonic() < deadline, "the beam search went on after the client left"
        done = now
    assert done - before < 1 + 4 * 899  # the whole search's requests: it did not run to the end
    server.wait_idle()
    server.engine.engine.check_integrity()


class _LongBeams:
    """The server's engine, but the beam requests after the first step ask for 500 tokens: step 1 stays in flight
    (all of its beams running) until cancelled."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def add_request(self, request_id, prompt, params):
        from dataclasses import replace

        if "-s0-" not in request_id:
            params = replace(params, max_tokens=500)
        return await self._engine.add_request(request_id, prompt, params)


def test_cancelled_driver_aborts_its_requests_in_flight(server):
    """The driver on its own (another event loop on the same engine): cancelled mid-step, it aborts every beam
    request in flight and leaves no KV block behind."""
    from vlserve.engine.beam_search_async import beam_search

    engine = _LongBeams(server.engine)

    async def run() -> None:
        prompt = await engine.process_prompt(EOS_PROMPT)
        params = BeamSearchParams(beam_width=8, max_tokens=20, ignore_eos=True)
        task = asyncio.ensure_future(beam_search(engine, prompt, params, "cancel-me"))
        deadline = time.monotonic() + 20
        while server.metrics()["vlserve:num_requests_running"] < 8:  # step 1: the 8 beams in flight
            assert not task.done() and time.monotonic() < deadline
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    before = _aborted(server)
    asyncio.run(run())
    server.wait_idle()
    assert _aborted(server) == before + 8
    server.engine.engine.check_integrity()


def test_cancelled_driver_mid_search(server):
    """Cancelled at any point of a real search (between steps or in one), the engine ends idle."""
    from vlserve.engine.beam_search_async import beam_search

    engine = server.engine

    async def run(delay: float) -> None:
        prompt = await engine.process_prompt(EOS_PROMPT)
        task = asyncio.ensure_future(beam_search(engine, prompt, BeamSearchParams(8, 900, ignore_eos=True), "c"))
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    for delay in (0.05, 0.2, 0.41):
        asyncio.run(run(delay))
        server.wait_idle()
    server.engine.engine.check_integrity()


def test_engine_process_server(text_ckpt, offline_llm):
    """`vlserve serve`'s default engine (its own process): the same beams; a hang-up leaves nothing held there."""
    from tests.api.conftest import TEXT_ENGINE_KW
    from tests.api.test_engine_process import assert_engine_idle, start_proc_server
    from vlserve.config import EngineArgs

    served = start_proc_server(EngineArgs(model=text_ckpt, served_model_name="tiny-text", **TEXT_ENGINE_KW))
    try:
        texts, reasons, _ = expected(offline_llm, EOS_PROMPT, 4, 16)
        r = complete(served, EOS_PROMPT, n=4, max_tokens=16)
        assert [c.text for c in r.choices] == texts and [c.finish_reason for c in r.choices] == reasons
        body = {"model": served.model, "prompt": EOS_PROMPT, "n": 4, "max_tokens": 900, "ignore_eos": True, **BEAM}
        with httpx.Client(base_url=served.base_url, timeout=httpx.Timeout(60, read=0.5), trust_env=False) as client:
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/completions", json=body)
        time.sleep(0.5)
        assert_engine_idle(served)
    finally:
        served.close()
