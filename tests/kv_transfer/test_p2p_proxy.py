"""End to end (issue 37): two `vlserve serve` processes on the tiny checkpoint, a P2P producer and a P2P consumer,
behind `vlserve proxy`; greedy completions through the proxy (prefill on the producer, decode on the consumer
reading the producer's KV) equal a plain server's, text for text, streamed or not."""
from __future__ import annotations

import contextlib
import json
import os
import time

import httpx
import pytest

from tests.api.conftest import serve_subprocess

pytestmark = pytest.mark.slow

PROMPTS = ["the quick brown fox jumps over", "hello there my friend, how are", "one two three four five six seven",
           "a b c d e f g h i j k l m n o p q r s t u v w"]
MSGS = [{"role": "user", "content": "tell me about foxes and dogs"}]


def _serve_args(model_dir, role=None):
    args = [model_dir, "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256", "--block-size", "4",
            "--served-model-name", "tiny", "--log-level", "warning"]
    if role is not None:
        args += ["--kv-transfer-config", json.dumps({"kv_connector": "P2PConnector", "kv_role": role})]
    return args


@pytest.fixture(scope="module")
def stack(qwen2_dir, mooncake, repo_root):
    site = tuple(p for p in [os.environ.get("VLSERVE_MOONCAKE_SITE")] if p)
    with contextlib.ExitStack() as es:
        prod = es.enter_context(serve_subprocess(_serve_args(qwen2_dir, "kv_producer"), repo_root, 240,
                                                 extra_paths=site))
        cons = es.enter_context(serve_subprocess(_serve_args(qwen2_dir, "kv_consumer"), repo_root, 240,
                                                 extra_paths=site))
        plain = es.enter_context(serve_subprocess(_serve_args(qwen2_dir), repo_root, 240))
        proxy = es.enter_context(serve_subprocess(["--prefill", prod, "--decode", cons, "--log-level", "warning"],
                                                  repo_root, 60, command="proxy"))
        yield prod, cons, plain, proxy


@pytest.fixture(scope="module")
def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _post(base, path, body):
    r = httpx.post(f"{base}{path}", json=body, timeout=120, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(base, name):
    for line in httpx.get(f"{base}/metrics", trust_env=False).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not on {base}/metrics")


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
    text = ""
    with httpx.stream("POST", f"{proxy}/v1/chat/completions", json={**body, "stream": True}, timeout=120,
                      trust_env=False) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
    assert text == want


def test_proxy_models_health_and_errors(stack):
    prod, cons, plain, proxy = stack
    assert httpx.get(f"{proxy}/health", trust_env=False).status_code == 200
    models = httpx.get(f"{proxy}/v1/models", trust_env=False).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    r = httpx.post(f"{proxy}/v1/completions", json={"model": "tiny", "prompt": "x", "temperature": "hot"},
                   trust_env=False, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
