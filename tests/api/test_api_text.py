"""Chat and completions over HTTP with the official openai client: streamed == non-streamed == offline LLM."""

from __future__ import annotations

import json

import pytest

from vlserve import SamplingParams

MESSAGES = [{"role": "user", "content": "Hello world, what color is the big red circle on the left?"}]
NO_EOS = {"ignore_eos": True}


def offline_chat(llm, messages, **kw):
    params = SamplingParams(temperature=0.0, **kw)
    return llm.chat(messages, params, use_tqdm=False)[0]


def stream_text(chunks) -> tuple[str, str | None]:
    text, finish = "", None
    for c in chunks:
        for ch in c.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    return text, finish


def test_models_health_version(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["tiny-text", "alias"]
    assert server.http.get("/health").status_code == 200
    assert server.http.get("/version").json()["version"]


def test_chat_stream_equals_nonstream_equals_offline(server, offline_llm):
    ref = offline_chat(offline_llm, MESSAGES, max_tokens=24, ignore_eos=True)
    expected = ref.outputs[0].text
    assert len(ref.outputs[0].token_ids) == 24
    r = server.client.chat.completions.create(
        model="tiny-text", messages=MESSAGES, temperature=0, max_tokens=24, extra_body=NO_EOS
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24

    chunks = list(
        server.client.chat.completions.create(
            model="alias",
            messages=MESSAGES,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text, finish = stream_text(chunks)
    assert text == expected and finish == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.model == "alias" for c in chunks)


def test_default_stop_on_eos_matches_offline(server, offline_llm):
    ref = offline_chat(offline_llm, MESSAGES, max_tokens=64)
    r = server.client.chat.completions.create(model="tiny-text", messages=MESSAGES, temperature=0, max_tokens=64)
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason


def test_raw_sse_framing(server):
    body = {"model": "tiny-text", "messages": MESSAGES, "max_tokens": 4, "stream": True, "temperature": 0}
    with server.http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    for e in events[:-1]:
        assert json.loads(e[6:])["object"] == "chat.completion.chunk"

    body.update(stream_options={"include_usage": True, "continuous_usage_stats": True}, ignore_eos=True)
    with server.http.stream("POST", "/v1/chat/completions", json=body) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks[1:]]
    assert counts == sorted(counts) and counts[-1] == 4


def test_stop_string_streamed_and_not(server, offline_llm):
    full = offline_chat(offline_llm, MESSAGES, max_tokens=24, ignore_eos=True).outputs[0].text
    stop = full[6:8]  # two characters from the middle: likely straddles a token boundary
    cut = full[: full.find(stop)]
    r = server.client.chat.completions.create(
        model="tiny-text", messages=MESSAGES, temperature=0, max_tokens=24, stop=[stop], extra_body=NO_EOS
    )
    assert r.choices[0].message.content == cut
    assert r.choices[0].finish_reason == "stop"
    text, finish = stream_text(
        server.client.chat.completions.create(
            model="tiny-text",
            messages=MESSAGES,
            temperature=0,
            max_tokens=24,
            stop=stop,
            stream=True,
            extra_body=NO_EOS,
        )
    )
    assert (text, finish) == (cut, "stop")


def test_max_completion_tokens_and_cached_tokens(server):
    long_messages = [{"role": "user", "content": "one two three four five six seven eight nine ten " * 4}]
    kw = dict(model="tiny-text", messages=long_messages, temperature=0, max_completion_tokens=5, extra_body=NO_EOS)
    first = server.client.chat.completions.create(**kw)
    second = server.client.chat.completions.create(**kw)
    assert first.usage.completion_tokens == 5 and first.choices[0].finish_reason == "length"
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_sampling_n_seed_and_penalties(server):
    kw = dict(
        model="tiny-text",
        messages=MESSAGES,
        temperature=1.0,
        top_p=0.9,
        max_tokens=12,
        n=3,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.2, "ignore_eos": True},
    )
    a = server.client.chat.completions.create(**kw)
    b = server.client.chat.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1
    assert a.usage.completion_tokens == 36
    chunks = list(server.client.chat.completions.create(**kw, stream=True))
    streamed = {i: "" for i in range(3)}
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert [streamed[i] for i in range(3)] == [c.message.content for c in a.choices]


def test_chat_logprobs(server):
    r = server.client.chat.completions.create(
        model="tiny-text",
        messages=MESSAGES,
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        extra_body=NO_EOS,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for tok in content:
        assert len(tok.top_logprobs) == 3
        assert tok.logprob <= 0 and tok.top_logprobs[0].logprob == pytest.approx(tok.logprob, abs=1e-5)
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[1].logprob >= tok.top_logprobs[2].logprob
    assert "".join(t.token for t in content) == r.choices[0].message.content


def test_completions(server, offline_llm):
    prompts = ["the quick brown fox", "one two three"]
    refs = offline_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    r = server.client.completions.create(
        model="tiny-text", prompt=prompts, temperature=0, max_tokens=10, extra_body=NO_EOS
    )
    assert r.object == "text_completion"
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.outputs[0].text for o in refs]
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in refs)
    assert r.usage.completion_tokens == 20

    ids = refs[0].prompt_token_ids
    r2 = server.client.completions.create(
        model="tiny-text", prompt=ids, temperature=0, max_tokens=10, extra_body=NO_EOS
    )
    assert r2.choices[0].text == refs[0].outputs[0].text

    chunks = list(
        server.client.completions.create(
            model="tiny-text",
            prompt=prompts,
            temperature=0,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert [texts[0], texts[1]] == [o.outputs[0].text for o in refs]
    assert chunks[-1].usage.completion_tokens == 20


def test_completion_logprobs(server):
    r = server.client.completions.create(
        model="tiny-text", prompt="hello world", temperature=0, max_tokens=5, logprobs=2, extra_body=NO_EOS
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text


def test_metrics_endpoint(server):
    server.client.chat.completions.create(model="tiny-text", messages=MESSAGES, max_tokens=3)
    text = server.http.get("/metrics").text
    for name in (
        "vlserve:num_requests_running",
        "vlserve:num_requests_waiting",
        "vlserve:kv_cache_usage",
        "vlserve:prefix_cache_queries_total",
        "vlserve:prompt_tokens_total",
        "vlserve:generation_tokens_total",
        "vlserve:encoder_cache_usage",
        "vlserve:time_to_first_token_seconds_bucket",
        "vlserve:inter_token_latency_seconds_bucket",
        "vlserve:e2e_request_latency_seconds_count",
        "vlserve:request_success_total{finished_reason=",
        'vlserve:http_requests_total{endpoint="/v1/chat/completions",status="200"}',
    ):
        assert name in text, name
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}  # valid exposition format
    assert families["vlserve:time_to_first_token_seconds"].type == "histogram"
    assert families["vlserve:prompt_tokens"].type == "counter"
    assert families["vlserve:kv_cache_usage"].type == "gauge"
    m = server.metrics()
    assert m["vlserve:time_to_first_token_seconds_count"] >= 1
    assert m["vlserve:generation_tokens_total"] >= 3
