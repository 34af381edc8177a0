"""Many concurrent streams all complete with the offline text; a client disconnect aborts and frees its request."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from vlserve import SamplingParams

COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
SHAPES = ["circle", "square", "triangle", "dog"]


def conversations(n: int) -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"question {i}: where is the {COLORS[i % 8]} {SHAPES[i // 8 % 4]}?"}]
        for i in range(n)
    ]


def test_concurrent_streams_complete_with_expected_text(server, offline_llm):
    convs = conversations(32)
    refs = offline_llm.chat(convs, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    expected = [r.outputs[0].text for r in refs]

    async def one(client, messages) -> str:
        stream = await client.chat.completions.create(
            model="tiny-text",
            messages=messages,
            temperature=0,
            max_tokens=16,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(one(client, m) for m in convs))

    got = asyncio.run(run_all())
    assert got == expected
    server.wait_idle()
    server.engine.engine.check_integrity()


def _aborted(server) -> float:
    return server.metrics()["vlserve:num_aborted_requests_total"]


def test_disconnect_mid_stream_frees_the_request(server):
    before = _aborted(server)
    body = {
        "model": "tiny-text",
        "messages": conversations(1)[0],
        "max_tokens": 900,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few tokens, then hang up
            assert any('"content"' in g for g in got)
            assert server.metrics()["vlserve:num_requests_running"] == 1
    m = server.wait_idle()
    assert m["vlserve:num_requests_running"] == 0 and m["vlserve:kv_cache_usage"] == 0
    deadline = time.monotonic() + 10
    while _aborted(server) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborted(server) == before + 1
    assert server.metrics_labelled()['vlserve:request_success_total{finished_reason="abort"}'] >= 1
    server.engine.engine.check_integrity()


def test_disconnect_while_waiting_for_non_streamed_response(server):
    before = _aborted(server)
    body = {"model": "tiny-text", "messages": conversations(2)[1], "max_tokens": 900, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(60, read=0.3), trust_env=False) as client:
        try:
            client.post("/v1/chat/completions", json=body)
            raise AssertionError("expected the read to time out before 900 tokens were generated")
        except httpx.ReadTimeout:
            pass
    server.wait_idle()
    deadline = time.monotonic() + 10
    while _aborted(server) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborted(server) == before + 1
    server.engine.engine.check_integrity()


def test_speculative_decoding_server_streams_the_same_greedy_text(text_ckpt, offline_llm):
    """--speculative-config reaches the engine; multi-token steps stream the same text as plain decoding."""
    from tests.api.conftest import TEXT_ENGINE_KW, start_server
    from vlserve.config import EngineArgs

    # A repetitive prompt so n-gram drafts actually get proposed (and some accepted).
    messages = [{"role": "user", "content": "red blue red blue red blue red blue red blue red blue"}]
    ref = (
        offline_llm.chat(messages, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    served = start_server(EngineArgs(model=text_ckpt, speculative_config=spec, **TEXT_ENGINE_KW))
    try:
        kw = dict(model=served.model, messages=messages, temperature=0, max_tokens=40, extra_body={"ignore_eos": True})
        assert served.client.chat.completions.create(**kw).choices[0].message.content == ref
        chunks = served.client.chat.completions.create(**kw, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
        assert served.metrics()["vlserve:spec_decode_num_drafts_total"] > 0
        served.wait_idle()
    finally:
        served.close()
