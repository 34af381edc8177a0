"""Faults in disaggregated serving, with `vlserve serve` processes stopped (SIGSTOP) or killed
(SIGKILL): a producer that hangs or dies after its prefill answered (the consumer still answers, recomputing, as a
plain server), a consumer that never pulls (the producer frees what it kept after send_timeout_s), and the proxy
with dead prefill / decode servers (it fails over to live ones, or answers a JSON 503 when none is left). Nothing
leaks on either side: the /metrics gauges (kept blocks, requests waiting for remote KV, used blocks) return to 0."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import httpx
import psutil
import pytest

from tests.api.conftest import serve_subprocess
from tests.kv_transfer.servers import REPO_ROOT, mooncake_site
from tests.kv_transfer.servers import metric as _metric
from tests.kv_transfer.servers import post as _post
from tests.kv_transfer.servers import serve_args as _serve_args

pytestmark = pytest.mark.slow

NUM_BLOCKS = 64
SEND_TIMEOUT_S = 5.0
PROMPTS = [
    "the quick brown fox jumps over",
    "hello there my friend, how are",
    "one two three four five six seven",
    "a b c d e f g h i j k l m n o p q r s t u v w",
]
LATE = ["seven eight nine ten eleven twelve thirteen", "my dog likes to run in the park every day"]


@pytest.fixture(scope="module")
def stack(qwen2_dir, mooncake):
    """Two producers (p1 stays up, p2 is killed) and two consumers (c1 stays up, c2 is killed) behind one proxy;
    `procs[name]` is each server's Popen."""
    site = mooncake_site()
    with contextlib.ExitStack() as es:
        urls, procs = {}, {}
        for name, role in (("p1", "kv_producer"), ("p2", "kv_producer"), ("c1", "kv_consumer"), ("c2", "kv_consumer")):
            started: list = []
            urls[name] = es.enter_context(
                serve_subprocess(
                    _serve_args(qwen2_dir, role, send_timeout_s=SEND_TIMEOUT_S),
                    REPO_ROOT,
                    240,
                    extra_paths=site,
                    procs=started,
                )
            )
            procs[name] = started[0]
        urls["proxy"] = es.enter_context(
            serve_subprocess(
                [
                    "--prefill",
                    urls["p2"],
                    urls["p1"],
                    "--decode",
                    urls["c2"],
                    urls["c1"],
                    "--backoff",
                    "60",
                    "--log-level",
                    "warning",
                ],
                REPO_ROOT,
                60,
                command="proxy",
            )
        )
        yield urls, procs


def _kill(proc) -> None:
    """SIGKILL a server and every process under it (its engine process holds the KV cache and side channel)."""
    if proc.poll() is not None:
        return
    tree = psutil.Process(proc.pid).children(recursive=True)
    for p in [psutil.Process(proc.pid), *tree]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    proc.wait(10)
    psutil.wait_procs(tree, timeout=10)


def _wait_metric(base, name, want, limit_s):
    deadline = time.monotonic() + limit_s
    while (got := _metric(base, name)) != want:
        assert time.monotonic() < deadline, (
            f"{name} on {base} is {got}, not {want}, after {limit_s} s (waiting for "
            f"KV: {_metric(base, 'vlserve:num_requests_waiting_for_kv')})"
        )
        time.sleep(0.1)


def _body(prompt, **kw):
    return {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 12, "ignore_eos": True, **kw}


def _reference(c1, prompt):
    """A plain request on the consumer (no kv_transfer_params): what one server answers."""
    return _post(c1, "/v1/completions", _body(prompt))["choices"][0]["text"]


def _assert_no_leak(base):
    _wait_metric(base, "vlserve:kv_used_blocks", 0, 10)
    assert _metric(base, "vlserve:kv_free_blocks") == NUM_BLOCKS
    assert _metric(base, "vlserve:num_requests_waiting_for_kv") == 0
    assert _metric(base, "vlserve:kv_kept_blocks") == 0
    assert _metric(base, "vlserve:engine_requests_held") == 0
    assert _metric(base, "vlserve:encoder_cache_referencing_requests") == 0


def _signal_tree(proc, sig) -> None:
    for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        p.send_signal(sig)


def _prefill(base, prompt):
    return _post(base, "/v1/completions", _body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))[
        "kv_transfer_params"
    ]


def test_producer_hung_during_the_read_consumer_recomputes(stack):
    """The producer stops answering (SIGSTOP) once its prefill answered: the consumer's read fails on Mooncake's
    transfer timeout and it recomputes; resumed, the producer frees what it kept (confirmation or its timeout)."""
    urls, procs = stack
    p2, c1 = urls["p2"], urls["c1"]
    params = _prefill(p2, PROMPTS[0])  # one good transfer: c1 knows p2's cache, the next read goes to Mooncake
    got = _post(c1, "/v1/completions", _body(PROMPTS[0], kv_transfer_params=params))["choices"][0]["text"]
    assert got == _reference(c1, PROMPTS[0])
    failed = _metric(c1, "vlserve:kv_p2p_failed_loads_total")
    params = _prefill(p2, PROMPTS[3])
    _signal_tree(procs["p2"], signal.SIGSTOP)
    try:
        got = _post(c1, "/v1/completions", _body(PROMPTS[3], kv_transfer_params=params))["choices"][0]["text"]
    finally:
        _signal_tree(procs["p2"], signal.SIGCONT)
    assert got == _reference(c1, PROMPTS[3])
    assert _metric(c1, "vlserve:kv_p2p_failed_loads_total") == failed + 1
    _assert_no_leak(c1)
    _wait_metric(p2, "vlserve:kv_kept_requests", 0, SEND_TIMEOUT_S + 10)
    _assert_no_leak(p2)


def test_producer_killed_while_and_before_the_consumer_reads(stack):
    """The producer is killed with a consumer's read in flight (it was stopped, so the read waits on it), and a
    second request's params name it after it died: the consumer recomputes both, as a plain server answers."""
    import threading

    urls, procs = stack
    p2, c1 = urls["p2"], urls["c1"]
    # one good transfer first: c1 then knows p2's cache and reads it with Mooncake (not only the side channel)
    params = _prefill(p2, PROMPTS[2])
    got = _post(c1, "/v1/completions", _body(PROMPTS[2], kv_transfer_params=params))["choices"][0]["text"]
    assert got == _reference(c1, PROMPTS[2])
    failed = _metric(c1, "vlserve:kv_p2p_failed_loads_total")
    during, after = _prefill(p2, LATE[0]), _prefill(p2, LATE[1])
    assert _metric(p2, "vlserve:kv_kept_requests") == 2
    _signal_tree(procs["p2"], signal.SIGSTOP)
    answer = {}
    reader = threading.Thread(
        target=lambda: answer.update(_post(c1, "/v1/completions", _body(LATE[0], kv_transfer_params=during)))
    )
    reader.start()
    try:
        _wait_metric(c1, "vlserve:num_requests_waiting_for_kv", 1, 20)  # its read is in flight
    finally:
        _kill(procs["p2"])  # its KV is gone with it
    t0 = time.monotonic()
    reader.join(60)
    assert not reader.is_alive()
    assert answer["choices"][0]["text"] == _reference(c1, LATE[0])
    got = _post(c1, "/v1/completions", _body(LATE[1], kv_transfer_params=after))["choices"][0]["text"]
    assert got == _reference(c1, LATE[1])
    assert time.monotonic() - t0 < 20  # a dead producer fails the reads at once (no transfer timeout)
    assert _metric(c1, "vlserve:kv_p2p_failed_loads_total") == failed + 2
    _assert_no_leak(c1)


def test_consumer_never_pulls_producer_frees_after_timeout(stack):
    urls, _ = stack
    p1 = urls["p1"]
    timeouts = _metric(p1, "vlserve:kv_p2p_send_timeouts_total")
    params = _prefill(p1, PROMPTS[2])
    assert _metric(p1, "vlserve:kv_kept_requests") == 1
    assert _metric(p1, "vlserve:kv_kept_blocks") == len(params["remote_block_ids"]) > 0
    _wait_metric(p1, "vlserve:kv_kept_requests", 0, SEND_TIMEOUT_S + 10)
    assert _metric(p1, "vlserve:kv_p2p_send_timeouts_total") == timeouts + 1
    _assert_no_leak(p1)


def test_proxy_fails_over_dead_prefill_and_decode_servers(stack):
    urls, procs = stack
    p1, c1, proxy = urls["p1"], urls["c1"], urls["proxy"]
    _kill(procs["p2"])
    _kill(procs["c2"])
    kept, loaded = (_metric(p1, "vlserve:kv_p2p_kept_requests_total"), _metric(c1, "vlserve:kv_p2p_loads_done_total"))
    for prompt in PROMPTS:  # the proxy lists the dead servers first: every request fails over to p1 / c1
        assert _post(proxy, "/v1/completions", _body(prompt))["choices"][0]["text"] == _reference(c1, prompt)
    text = ""
    with httpx.stream(
        "POST", f"{proxy}/v1/completions", json=_body(PROMPTS[0], stream=True), timeout=120, trust_env=False
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == _reference(c1, PROMPTS[0])
    assert _metric(p1, "vlserve:kv_p2p_kept_requests_total") == kept + 5
    assert _metric(c1, "vlserve:kv_p2p_loads_done_total") == loaded + 5
    health = httpx.get(f"{proxy}/health", trust_env=False)
    assert health.status_code == 503 and set(health.json()["down"]) == {urls["p2"], urls["c2"]}
    _wait_metric(p1, "vlserve:kv_kept_requests", 0, 10)  # every consumer read confirmed
    _assert_no_leak(p1)
    _assert_no_leak(c1)


def test_proxy_without_a_live_decode_server_errors_and_the_producer_frees(stack):
    """Every decode server down: a JSON 503 naming them; the prefill server's kept blocks go after its timeout."""
    from fastapi.testclient import TestClient

    from vlserve.api.disagg_proxy import build_proxy_app

    urls, procs = stack
    _kill(procs["c2"])
    p1 = urls["p1"]
    timeouts = _metric(p1, "vlserve:kv_p2p_send_timeouts_total")
    with TestClient(build_proxy_app([p1], [urls["c2"]], backoff_s=60)) as client:
        for _ in range(2):  # the second call finds c2 backing off: tried anyway, as the last one left
            r = client.post("/v1/completions", json=_body(PROMPTS[3]))
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert "no decode server available" in err["message"] and urls["c2"] in err["message"]
    _wait_metric(p1, "vlserve:kv_p2p_send_timeouts_total", timeouts + 2, SEND_TIMEOUT_S + 10)
    _assert_no_leak(p1)


def test_proxy_with_a_decode_server_that_times_out(stack):
    """A decode server whose API process stops answering (SIGSTOP) past the proxy's --timeout: a JSON 504, not
    retried; resumed, it finishes or drops the request, and neither side keeps anything. (Only the API process is
    stopped: stopping its engine process too freezes Mooncake's transfer engine mid-session, and a read started
    after the resume was then seen to hang past 45 s in 3 of ~11 runs — a hung-peer case the connector only
    bounds by Mooncake's own timeout; see docs/architecture.md.)"""
    from fastapi.testclient import TestClient

    from vlserve.api.disagg_proxy import build_proxy_app

    urls, procs = stack
    p1, c1 = urls["p1"], urls["c1"]
    with TestClient(build_proxy_app([p1], [c1], timeout=3, backoff_s=60)) as client:
        os.kill(procs["c1"].pid, signal.SIGSTOP)
        try:
            r = client.post("/v1/completions", json=_body(LATE[0]))
        finally:
            os.kill(procs["c1"].pid, signal.SIGCONT)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == 504 and f"decode server {c1} timed out" in r.json()["error"]["message"]
    _wait_metric(p1, "vlserve:kv_kept_requests", 0, SEND_TIMEOUT_S + 10)
    _assert_no_leak(p1)
    # (the decode server resumes with the request in its socket: it may still read p1's blocks, or recompute; a
    # read that Mooncake does not answer fails after its transfer timeout, ~30 s, and then recomputes)
    try:
        _wait_metric(c1, "vlserve:engine_requests_held", 0, 90)
    except AssertionError:
        if _metric(c1, "vlserve:num_requests_waiting_for_kv") == 1:  # the limit docs/architecture.md names
            pytest.xfail(
                "known limit: a KV read on the resumed decode server is still running after 90 s (reads "
                "have no deadline of their own; docs/architecture.md)"
            )
        raise
    _assert_no_leak(c1)
    assert _post(c1, "/v1/completions", _body(LATE[0]))["choices"][0]["text"]  # c1 carries on
