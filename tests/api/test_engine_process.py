"""The server with the engine core in its own process: same outputs as the in-thread engine, aborts cross, no
leaks, a bad checkpoint's error reaches the user, and a killed engine fails requests with 5xx instead of hanging."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.api.conftest import TEXT_ENGINE_KW, Served, ServerThread, free_port
from tests.api.test_api_concurrency import conversations
from vlserve import SamplingParams


def start_proc_server(engine_args, **config_kw) -> Served:
    from vlserve.api.server import ServerConfig, build_app
    from vlserve.engine.mp_async_llm import MPAsyncLLM

    engine = MPAsyncLLM.from_engine_args(engine_args, startup_timeout=120)
    app = build_app(engine, ServerConfig(shutdown_engine=False, **config_kw))
    return Served(engine, ServerThread(app).start(), app.state.models.names[0])


@pytest.fixture(scope="module")
def proc_server(text_ckpt):
    from vlserve.config import EngineArgs

    served = start_proc_server(EngineArgs(model=text_ckpt, served_model_name="tiny-text", **TEXT_ENGINE_KW))
    yield served
    served.close()


def stream_all(base_url: str, convs: list[list[dict]], **kw) -> list[str]:
    """All conversations at once as streams through the openai client; their texts in order."""

    async def one(client, messages) -> str:
        stream = await client.chat.completions.create(
            model="tiny-text",
            messages=messages,
            temperature=0,
            max_tokens=16,
            stream=True,
            extra_body={"ignore_eos": True},
            **kw,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, m) for m in convs))

    return asyncio.run(run_all())


def assert_engine_idle(served: Served) -> None:
    """The engine process's own counters (they come back in its step messages): nothing held."""
    m = served.wait_idle()
    assert m["vlserve:kv_cache_usage"] == 0 and m["vlserve:engine_requests_held"] == 0
    assert m["vlserve:encoder_cache_referencing_requests"] == 0  # entries may stay cached, but unreferenced
    assert not served.engine.engine_loop.output_processor.parents and not served.engine._pending


def test_64_streams_equal_the_in_thread_engine(proc_server, server):
    convs = conversations(64)
    got = stream_all(proc_server.base_url, convs)
    assert got == stream_all(server.base_url, convs)
    assert len(set(got)) > 1 and all(got)
    assert proc_server.engine.engine_pid != os.getpid()
    assert proc_server.metrics()["vlserve:generation_tokens_total"] >= 64 * 16  # counted in the engine process
    successes = sum(v for k, v in proc_server.metrics_labelled().items() if k.startswith("vlserve:request_success"))
    assert successes >= 64  # counted here, from the outputs that crossed
    assert_engine_idle(proc_server)


def test_async_scheduling_in_the_engine_process_equals_the_in_thread_engine(text_ckpt, server):
    """--async-scheduling runs inside the engine process (its runner thread there); same texts, nothing held."""
    from vlserve.config import EngineArgs

    served = start_proc_server(
        EngineArgs(model=text_ckpt, served_model_name="tiny-text", async_scheduling=True, **TEXT_ENGINE_KW)
    )
    try:
        convs = conversations(16)
        assert stream_all(served.base_url, convs) == stream_all(server.base_url, convs)
        assert_engine_idle(served)
    finally:
        served.close()


def test_stop_strings_and_n_equal_the_in_thread_engine(proc_server, server):
    """Stop strings are found by the API-side detokenizer and finished in the engine; n=2 fans out there too."""
    msgs = conversations(3)[2]
    full = proc_server.client.chat.completions.create(
        model="tiny-text", messages=msgs, temperature=0, max_tokens=16, extra_body={"ignore_eos": True}
    )
    stop = full.choices[0].message.content[3:6]
    kw = dict(
        model="tiny-text",
        messages=msgs,
        temperature=0,
        max_tokens=16,
        stop=[stop],
        n=2,
        extra_body={"ignore_eos": True},
    )
    got = proc_server.client.chat.completions.create(**kw)
    ref = server.client.chat.completions.create(**kw)
    assert [c.message.content for c in got.choices] == [c.message.content for c in ref.choices]
    assert got.choices[0].finish_reason == "stop" and len(got.choices[0].message.content) < len(stop) + 3 + 1
    assert_engine_idle(proc_server)


def test_request_the_engine_refuses_raises_its_error(proc_server):
    """The engine's scheduler refusal crosses back as the same ValueError from add_request, leaving nothing held:
    engine id "0_r" is already taken by request "r"'s first of n=2 sequences."""
    engine = proc_server.engine

    async def run() -> str:
        prompt = await engine.process_prompt("hello there")
        first = await engine.add_request("r", prompt, SamplingParams(n=2, max_tokens=400, ignore_eos=True))
        async with first:
            with pytest.raises(ValueError, match="already in use") as err:
                await engine.add_request("0_r", prompt, SamplingParams(max_tokens=4))
        return str(err.value)

    assert "0_r" in asyncio.run(run())
    assert_engine_idle(proc_server)


def test_client_disconnect_aborts_in_the_engine(proc_server):
    before = proc_server.metrics()["vlserve:num_aborted_requests_total"]
    body = {
        "model": "tiny-text",
        "messages": conversations(1)[0],
        "max_tokens": 900,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=proc_server.base_url, timeout=60, trust_env=False) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert any('"content"' in next(lines) for _ in range(6))
            m = proc_server.metrics()  # the counters the engine sent with its AddAck or a later step
            assert m["vlserve:num_requests_running"] + m["vlserve:num_requests_waiting"] == 1
    assert_engine_idle(proc_server)  # the engine freed its KV blocks: the abort crossed
    assert proc_server.metrics()["vlserve:num_aborted_requests_total"] == before + 1


def test_killed_engine_fails_requests_with_5xx_and_health_503(proc_server):
    """Runs last in this module: it kills the shared server's engine process."""
    body = {"model": "tiny-text", "messages": conversations(1)[0], "max_tokens": 900, "ignore_eos": True}

    async def in_flight() -> tuple[httpx.Response, str]:
        async with httpx.AsyncClient(base_url=proc_server.base_url, timeout=60, trust_env=False) as client:
            plain = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
                assert resp.status_code == 200
                lines = resp.aiter_lines()
                assert '"content"' in await anext(lines) or '"content"' in await anext(lines)
                os.kill(proc_server.engine.engine_pid, signal.SIGKILL)
                rest = "\n".join([line async for line in lines])
            return await plain, rest

    plain, rest = asyncio.run(asyncio.wait_for(in_flight(), 60))
    assert plain.status_code >= 500 and "engine" in plain.json()["error"]["message"]
    assert '"error"' in rest and "engine" in rest
    assert proc_server.http.get("/health").status_code == 503
    assert proc_server.http.get("/metrics").status_code == 200
    r = proc_server.http.post("/v1/chat/completions", json={**body, "max_tokens": 2})
    assert r.status_code >= 500 and r.json()["error"]["message"]
    # a message for the dead engine (the abort sent while failing its requests) must not block: a PUSH socket with
    # no peer would wait forever, and the requests in flight with it
    import threading

    from vlserve.engine.core_messages import AbortRequests

    sender = threading.Thread(target=proc_server.engine.client.send, args=(AbortRequests(["gone-1"]),), daemon=True)
    sender.start()
    sender.join(5)
    assert not sender.is_alive(), "sending to a dead engine blocked"


def test_bad_checkpoint_error_reaches_the_user(text_ckpt, tmp_path, capsys):
    """Config and tokenizer load in the API process; the broken weights fail in the engine, whose error text
    `vlserve serve` prints before exiting 2."""
    from vlserve.cli import main

    bad = tmp_path / "bad"
    shutil.copytree(text_ckpt, bad)
    for name in os.listdir(bad):
        if name.endswith(".safetensors"):
            (bad / name).write_bytes(b"not a safetensors file")
    assert main(["serve", str(bad), "--port", str(free_port()), "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert "engine process failed to start: SafetensorError" in err and "header" in err


def start_cli_server(
    text_ckpt: str, repo_root: str, data_parallel_size: int = 1, extra_args: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, list[int]]:
    """`vlserve serve` (engine processes by default) as a subprocess, once healthy: (server, engine pids); its port
    is `server.port`."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vlserve.cli",
        "serve",
        text_ckpt,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--num-kv-blocks",
        "64",
        "--log-level",
        "warning",
        "--data-parallel-size",
        str(data_parallel_size),
        *extra_args,
    ]
    proc = subprocess.Popen(cmd, cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60 + 60 * data_parallel_size
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "server did not come up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    children = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
    engines = [int(c) for c in children if "spawn_main" in _cmdline(c)]
    assert len(engines) == data_parallel_size, f"expected {data_parallel_size} engine children among {children}"
    proc.port = port
    return proc, engines


def _cmdline(pid) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return ""


@pytest.mark.slow
def test_server_exits_nonzero_when_the_engine_is_killed(text_ckpt, repo_root):
    proc, (engine_pid,) = start_cli_server(text_ckpt, repo_root)
    try:
        os.kill(engine_pid, signal.SIGKILL)
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_engine_exits_when_the_server_is_killed(text_ckpt, repo_root):
    """No orphan: the engine process notices its parent is gone and exits."""
    proc, (engine_pid,) = start_cli_server(text_ckpt, repo_root)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{engine_pid}") and "spawn_main" in _cmdline(engine_pid):
        assert time.monotonic() < deadline, "the engine process outlived its server"
        time.sleep(0.2)
