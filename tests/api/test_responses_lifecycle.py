"""POST /v1/responses and the request's life: a client that hangs up (streamed or not) aborts the request, which
leaves no running request and no KV block behind."""

from __future__ import annotations

import time

import httpx

LONG = {"model": "tiny-text", "input": "Count the shapes: red blue red blue red blue", "max_output_tokens": 900}


def _aborted(server) -> float:
    return server.metrics()["vlserve:num_aborted_requests_total"]


def _wait_aborted(server, count: float) -> None:
    deadline = time.monotonic() + 10
    while _aborted(server) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborted(server) == count


def test_disconnect_mid_stream_frees_the_request(server):
    before = _aborted(server)
    with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as client:
        with client.stream("POST", "/v1/responses", json={**LONG, "stream": True}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = []
            while sum("response.output_text.delta" in g for g in got) < 3:  # a few tokens, then hang up
                got.append(next(lines))
            assert server.metrics()["vlserve:num_requests_running"] == 1
    m = server.wait_idle()
    assert m["vlserve:num_requests_running"] == 0 and m["vlserve:kv_cache_usage"] == 0
    _wait_aborted(server, before + 1)
    server.engine.engine.check_integrity()


def test_disconnect_while_waiting_for_a_non_streamed_response(server):
    before = _aborted(server)
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(60, read=0.3), trust_env=False) as client:
        try:
            client.post("/v1/responses", json=LONG)
            raise AssertionError("expected the read to time out before 900 tokens were generated")
        except httpx.ReadTimeout:
            pass
    server.wait_idle()
    _wait_aborted(server, before + 1)
    server.engine.engine.check_integrity()
    assert server.http.get("/health").status_code == 200
