"""The proxy's backend pools (`vlserve proxy`, issue 37 item 6): round-robin that skips a backend for a back-off
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
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = client.post(path, json={"model": "tiny", "max_tokens": 4, **body})
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == 503 and "no prefill server available" in err["message"]
            assert dead[0] in err["message"] and dead[1] in err["message"] and "ConnectError" in err["message"]
        r = client.get("/v1/models")
        assert r.status_code == 503 and "no decode server available" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 503
