"""kv_transfer_params over HTTP: the request field reaches the engine, a producer's params come back at
the top level of non-streamed /v1/completions and /v1/chat/completions bodies (as vLLM returns them), and a
consumer server given them answers as a plain server does; bad values and servers without a connector are 400s
naming the field."""

from __future__ import annotations

import httpx
import pytest

from vlserve.config import EngineArgs, KVTransferConfig

KW = dict(dtype="float32", num_kv_blocks=64, max_model_len=256, block_size=4, seed=0)
PROMPTS = ["the quick brown fox jumps over", "hello there my friend, how", "one two three four five six seven"]
MSGS = [{"role": "user", "content": "tell me about foxes and dogs"}]


@pytest.fixture(scope="module")
def servers(qwen2_dir, mooncake):
    from tests.api.conftest import start_server

    prod = start_server(
        EngineArgs(model=qwen2_dir, kv_transfer_config=KVTransferConfig("P2PConnector", "kv_producer"), **KW)
    )
    cons = start_server(
        EngineArgs(model=qwen2_dir, kv_transfer_config=KVTransferConfig("P2PConnector", "kv_consumer"), **KW)
    )
    plain = start_server(EngineArgs(model=qwen2_dir, **KW))
    yield prod, cons, plain
    for s in (prod, cons, plain):
        s.close()


def _post(served, path, body):
    return httpx.post(f"{served.thread.base_url}{path}", json=body, timeout=60, trust_env=False)


def _sched(served):
    return served.engine.engine.scheduler


def _wait_freed(served, limit_s=10.0):
    import time

    t0 = time.monotonic()
    while _sched(served).kv_transfer.kept_blocks:
        assert time.monotonic() - t0 < limit_s
        time.sleep(0.02)


def test_completions_prefill_then_decode_over_http(servers):
    prod, cons, plain = servers
    for prompt in PROMPTS:
        base = {"prompt": prompt, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
        want = _post(plain, "/v1/completions", base).json()["choices"][0]["text"]
        pre = _post(
            prod, "/v1/completions", {**base, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        )
        assert pre.status_code == 200, pre.text
        params = pre.json()["kv_transfer_params"]
        assert params["do_remote_prefill"] and params["remote_port"]
        out = _post(cons, "/v1/completions", {**base, "kv_transfer_params": params})
        assert out.status_code == 200, out.text
        assert out.json()["choices"][0]["text"] == want
        assert out.json()["kv_transfer_params"] is None  # a consumer has nothing to hand on
        _wait_freed(prod)
    assert cons.engine.get_metrics()["vlserve:kv_p2p_loaded_blocks_total"] > 0
    assert _post(plain, "/v1/completions", {"prompt": "x", "max_tokens": 1}).json()["kv_transfer_params"] is None


def test_chat_prefill_then_decode_over_http(servers):
    prod, cons, plain = servers
    base = {"messages": MSGS, "temperature": 0, "max_tokens": 10, "ignore_eos": True}
    want = _post(plain, "/v1/chat/completions", base).json()["choices"][0]["message"]["content"]
    pre = _post(
        prod, "/v1/chat/completions", {**base, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    )
    assert pre.status_code == 200, pre.text
    params = pre.json()["kv_transfer_params"]
    assert params["do_remote_prefill"]
    out = _post(cons, "/v1/chat/completions", {**base, "kv_transfer_params": params})
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["message"]["content"] == want
    _wait_freed(prod)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_kv_transfer_params_errors_name_the_field(servers, path):
    prod, _, plain = servers
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": MSGS}
    for bad in ("yes", 3, ["do_remote_decode"]):
        r = _post(prod, path, {**body, "max_tokens": 1, "kv_transfer_params": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    r = _post(plain, path, {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "kv_transfer_params" and "kv-transfer-config" in r.json()["error"]["message"]
    r = _post(prod, path, {**body, "max_tokens": 1, "n": 2, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    if path == "/v1/completions":
        r = _post(prod, path, {"prompt": ["a", "b"], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    assert not _sched(prod).kv_transfer.kept_blocks
