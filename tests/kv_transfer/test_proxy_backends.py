"""The proxy's backend pools (`vlserve proxy`): round-robin that skips a backend for a back-off
after a failed call (all are tried when all back off), and a JSON 503 naming each dead backend when no prefill server
is reachable (no server processes here: the backends are closed ports)."""

from __future__ import annotations

from vlserve.api.backend_pool import BackendPool


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_round_robin_skips_a_failed_backend_for_the_backoff():
    clock = _Clock()
    pool = BackendPool("prefill", ["a", "b", "c"], backoff_s=5, clock=clock)
    assert [pool.candidates()[0] for _ in range(4)] == ["a", "b", "c", "a"]
    pool.mark_failed("b")
    assert pool.down() == ["b"]
    assert [pool.candidates() for _ in range(3)] == [["c", "a"], ["c", "a"], ["a", "c"]]
    clock.t += 5  # back-off over: b is in turn again
    assert pool.down() == [] and pool.candidates() == ["b", "c", "a"]
    pool.mark_failed("c")
    pool.mark_ok("c")
    assert pool.down() == []


def test_all_backing_off_are_tried_oldest_failure_first():
    clock = _Clock()
    pool = BackendPool("decode", ["a", "b"], backoff_s=5, clock=clock)
    pool.mark_failed("b")
    clock.t += 1
    pool.mark_failed("a")
    assert pool.candidates() == ["b", "a"]
    assert pool.candidates() == ["b", "a"]


def test_proxy_with_no_live_prefill_server_answers_503_json():
    from fastapi.testclient import TestClient

    from vlserve.api.disagg_proxy import build_proxy_app
    from vlserve.distributed.kv_transfer.p2p.side_channel import free_port

    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
    with TestClient(build_proxy_app(dead[:2], dead[2:], backoff_s=60)) as client:
        for path, body in (
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            r = client.post(path, json={"model": "tiny", "max_tokens": 4, **body})
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == 503 and "no prefill server available" in err["message"]
            assert dead[0] in err["message"] and dead[1] in err["message"] and "ConnectError" in err["message"]
        r = client.get("/v1/models")
        assert r.status_code == 503 and "no decode server available" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 503


def test_send_fails_over_on_unreachable_and_5xx_but_not_on_a_timeout():
    """Refused and 502/503/504 backends are skipped (and backed off); a 4xx is the answer; a read timeout is a 504
    without a retry elsewhere (the work may be running there)."""
    import asyncio

    import httpx
    import pytest

    from vlserve.api.backend_pool import NoBackendError

    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        calls.append(host)
        if host == "refused":
            raise httpx.ConnectError("refused", request=request)
        if host == "busy":
            return httpx.Response(503, json={"error": "draining"})
        if host == "slow":
            raise httpx.ReadTimeout("slow", request=request)
        if host == "bad":
            return httpx.Response(400, json={"error": "yours"})
        return httpx.Response(200, json={"ok": host})

    async def run(pool, **kw):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await pool.send(client, "POST", "/v1/completions", json={}, **kw)

    pool = BackendPool("decode", ["http://refused", "http://busy", "http://good"], backoff_s=60)
    url, resp = asyncio.run(run(pool))
    assert (url, resp.status_code, resp.json()) == ("http://good", 200, {"ok": "good"})
    assert calls == ["refused", "busy", "good"] and pool.down() == ["http://refused", "http://busy"]
    calls.clear()
    assert asyncio.run(run(pool, stream=True))[0] == "http://good" and calls == ["good"]  # the others back off
    url, resp = asyncio.run(run(BackendPool("prefill", ["http://bad", "http://good"])))
    assert (url, resp.status_code) == ("http://bad", 400)  # the client's error, not the backend's: passed on
    calls.clear()
    with pytest.raises(NoBackendError) as e:
        asyncio.run(run(BackendPool("decode", ["http://slow", "http://good"])))
    assert e.value.status == 504 and "http://slow timed out" in str(e.value) and calls == ["slow"]
    with pytest.raises(NoBackendError) as e:
        asyncio.run(run(BackendPool("decode", ["http://refused", "http://busy"])))
    assert e.value.status == 503 and "ConnectError" in str(e.value) and "HTTP 503" in str(e.value)
