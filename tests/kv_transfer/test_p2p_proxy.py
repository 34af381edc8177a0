"""End to end: two `vlserve serve` processes on the tiny checkpoint, a P2P producer and a P2P consumer,
behind `vlserve proxy`; greedy completions through the proxy (prefill on the producer, decode on the consumer
reading the producer's KV) equal a plain server's, text for text, streamed or not."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.kv_transfer.servers import metric as _metric
from tests.kv_transfer.servers import p2p_stack, streamed_chat
from tests.kv_transfer.servers import post as _post

pytestmark = pytest.mark.slow

PROMPTS = [
    "the quick brown fox jumps over",
    "hello there my friend, how are",
    "one two three four five six seven",
    "a b c d e f g h i j k l m n o p q r s t u v w",
]
MSGS = [{"role": "user", "content": "tell me about foxes and dogs"}]


@pytest.fixture(scope="module")
def stack(qwen2_dir, mooncake):
    with p2p_stack(qwen2_dir) as urls:
        yield urls


def test_proxy_completions_equal_one_server(stack):
    prod, cons, plain, proxy = stack
    for prompt in PROMPTS:
        body = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 16, "ignore_eos": True}
        want = _post(plain, "/v1/completions", body)["choices"][0]["text"]
        got = _post(proxy, "/v1/completions", body)
        assert got["choices"][0]["text"] == want
        assert got["usage"]["completion_tokens"] == 16
    assert _metric(cons, "vlserve:kv_p2p_loaded_blocks_total") > 0  # the consumer read the producer's blocks
    assert _metric(cons, "vlserve:kv_p2p_failed_loads_total") == 0
    deadline = time.monotonic() + 10  # the idle producer frees what it kept on the consumer's confirmation
    while _metric(prod, "vlserve:kv_cache_usage") != 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_proxy_chat_and_streaming(stack):
    prod, cons, plain, proxy = stack
    body = {"model": "tiny", "messages": MSGS, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    want = _post(plain, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert _post(proxy, "/v1/chat/completions", body)["choices"][0]["message"]["content"] == want
    assert streamed_chat(proxy, body) == want


def test_proxy_models_health_and_errors(stack):
    prod, cons, plain, proxy = stack
    assert httpx.get(f"{proxy}/health", trust_env=False).status_code == 200
    models = httpx.get(f"{proxy}/v1/models", trust_env=False).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    r = httpx.post(
        f"{proxy}/v1/completions",
        json={"model": "tiny", "prompt": "x", "temperature": "hot"},
        trust_env=False,
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
