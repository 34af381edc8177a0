"""End to end (E/PD disaggregation): Qwen2-VL tiny behind `vlserve proxy --encode`. An encode
server (`--mm-encoder-only`, ec_producer) runs the image through its tower and publishes the encoder output; the
server that then prefills (a plain ec_consumer in E + PD, a P2P kv_producer + ec_consumer in E/P/D) loads it and
never runs its tower; the answer is a plain server's, streamed or not. An unreachable encode server is counted on
the proxy's /metrics and the request still succeeds (encoded where it runs). Text-only requests skip the encoder."""

from __future__ import annotations

import contextlib
import json

import pytest

from tests.api.conftest import serve_subprocess
from tests.kv_transfer.servers import REPO_ROOT, mooncake_site, streamed_chat
from tests.kv_transfer.servers import metric as _metric
from tests.kv_transfer.servers import post as _post
from tests.kv_transfer.servers import serve_args as _serve_args
from tests.kv_transfer.test_p2p_proxy_vl import _msgs
from vlserve.api.disagg_proxy import build_proxy_app, has_media


def _ec(role: str, path) -> list[str]:
    return [
        "--ec-transfer-config",
        json.dumps(
            {
                "ec_connector": "shared_storage",
                "ec_role": role,
                "ec_connector_extra_config": {"shared_storage_path": str(path)},
            }
        ),
    ]


def _body(seed: int, **kw) -> dict:
    return {"model": "tiny", "messages": _msgs(seed), "temperature": 0, "max_tokens": 10, "ignore_eos": True, **kw}


def test_has_media_and_proxy_flags():
    assert has_media(_body(1)) and not has_media({"messages": [{"role": "user", "content": "hi"}]})
    assert not has_media({"prompt": "hi"})
    with pytest.raises(ValueError, match="--prefill servers, --encode servers or both"):
        build_proxy_app(None, ["http://d"])
    with pytest.raises(ValueError, match="--decode"):
        build_proxy_app(None, [], encode=["http://e"])


@pytest.fixture(scope="module")
def e_pd_stack(qwen2_vl_dir, tmp_path_factory):
    ec_dir = tmp_path_factory.mktemp("ec")
    with contextlib.ExitStack() as es:
        enc = es.enter_context(
            serve_subprocess(
                _serve_args(qwen2_vl_dir) + ["--mm-encoder-only"] + _ec("ec_producer", ec_dir), REPO_ROOT, 240
            )
        )
        pd = es.enter_context(serve_subprocess(_serve_args(qwen2_vl_dir) + _ec("ec_consumer", ec_dir), REPO_ROOT, 240))
        plain = es.enter_context(serve_subprocess(_serve_args(qwen2_vl_dir), REPO_ROOT, 240))
        proxy = es.enter_context(
            serve_subprocess(
                ["--encode", enc, "--decode", pd, "--log-level", "warning"], REPO_ROOT, 60, command="proxy"
            )
        )
        yield enc, pd, plain, proxy


@pytest.mark.slow
def test_e_pd_image_chat_equals_one_server_and_pd_never_runs_its_tower(e_pd_stack):
    enc, pd, plain, proxy = e_pd_stack
    texts = []
    for seed in (1, 2):
        want = _post(plain, "/v1/chat/completions", _body(seed))
        got = _post(proxy, "/v1/chat/completions", _body(seed))
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert got["usage"] == want["usage"]
        assert streamed_chat(proxy, _body(seed)) == want["choices"][0]["message"]["content"]
        texts.append(want["choices"][0]["message"]["content"])
    assert texts[0] != texts[1]  # the image matters
    assert _metric(pd, "vlserve:encoder_runs_total") == 0  # the PD server loaded every image's encoder output
    assert _metric(pd, "vlserve:ec_load_hits_total") == 2  # each image once (streamed again: its own caches)
    assert _metric(enc, "vlserve:encoder_runs_total") == 2  # each image once (the second time: a cache hit)
    assert _metric(enc, "vlserve:generation_tokens_total") == 0 and _metric(enc, "vlserve:num_kv_blocks") == 0
    assert _metric(proxy, "vlserve:proxy_encode_requests_total") == 4
    assert _metric(proxy, "vlserve:proxy_encode_failures_total") == 0
    # text only: straight to the PD server
    text = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello there"}],
        "temperature": 0,
        "max_tokens": 6,
        "ignore_eos": True,
    }
    assert (
        _post(proxy, "/v1/chat/completions", text)["choices"] == _post(plain, "/v1/chat/completions", text)["choices"]
    )
    assert _metric(proxy, "vlserve:proxy_encode_requests_total") == 4
    # the encode server's own answer: no tokens, finish_reason "length"
    own = _post(enc, "/v1/chat/completions", _body(1))
    assert own["choices"][0]["message"]["content"] == "" and own["choices"][0]["finish_reason"] == "length"
    assert own["usage"]["completion_tokens"] == 0


@pytest.mark.slow
def test_encode_server_down_is_counted_and_the_request_goes_on(e_pd_stack):
    from fastapi.testclient import TestClient

    _, pd, plain, _ = e_pd_stack
    runs = _metric(pd, "vlserve:encoder_runs_total")
    app = build_proxy_app(None, [pd], encode=["http://127.0.0.1:9"])  # nothing listens there
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=_body(3))
        assert r.status_code == 200, r.text
        assert (
            r.json()["choices"][0]["message"]["content"]
            == _post(plain, "/v1/chat/completions", _body(3))["choices"][0]["message"]["content"]
        )
        assert "vlserve:proxy_encode_failures_total 1.0" in client.get("/metrics").text
    assert _metric(pd, "vlserve:encoder_runs_total") == runs + 1  # encoded where it ran


@pytest.fixture(scope="module")
def e_p_d_stack(qwen2_vl_dir, mooncake, tmp_path_factory):
    ec_dir = tmp_path_factory.mktemp("ec3")
    site = mooncake_site()
    with contextlib.ExitStack() as es:
        enc = es.enter_context(serve_subprocess(_serve_args(qwen2_vl_dir) + _ec("ec_producer", ec_dir), REPO_ROOT, 240))
        prod = es.enter_context(
            serve_subprocess(
                _serve_args(qwen2_vl_dir, "kv_producer") + _ec("ec_consumer", ec_dir), REPO_ROOT, 240, extra_paths=site
            )
        )
        cons = es.enter_context(
            serve_subprocess(_serve_args(qwen2_vl_dir, "kv_consumer"), REPO_ROOT, 240, extra_paths=site)
        )
        plain = es.enter_context(serve_subprocess(_serve_args(qwen2_vl_dir), REPO_ROOT, 240))
        proxy = es.enter_context(
            serve_subprocess(
                ["--encode", enc, "--prefill", prod, "--decode", cons, "--log-level", "warning"],
                REPO_ROOT,
                60,
                command="proxy",
            )
        )
        yield enc, prod, cons, plain, proxy


@pytest.mark.slow
def test_e_p_d_image_chat_equals_one_server(e_p_d_stack):
    enc, prod, cons, plain, proxy = e_p_d_stack
    for seed in (1, 2):
        want = _post(plain, "/v1/chat/completions", _body(seed))["choices"][0]["message"]["content"]
        assert _post(proxy, "/v1/chat/completions", _body(seed))["choices"][0]["message"]["content"] == want
        assert streamed_chat(proxy, _body(seed)) == want
    assert _metric(prod, "vlserve:encoder_runs_total") == 0  # the prefill server loaded the encoder outputs
    assert _metric(cons, "vlserve:encoder_runs_total") == 0  # the decode server read the prefill server's KV
    assert _metric(cons, "vlserve:kv_p2p_loaded_blocks_total") > 0
    assert _metric(enc, "vlserve:encoder_runs_total") == 2
