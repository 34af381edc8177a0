"""`--data-parallel-size 2`: two engine processes behind one server. Same outputs as one engine, affinity keeps
one image's encoder work on one replica, distinct prompts use both, /metrics per replica and summed, and a killed
replica fails requests with 5xx, /health 503 and a non-zero exit."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from tests.api.conftest import TEXT_ENGINE_KW, free_port
from tests.api.test_api_concurrency import conversations
from tests.api.test_api_media import NO_EOS, VL_ENGINE_KW, data_url, image_msg, offline_vl, png_bytes, vl_ckpt  # noqa: F401
from tests.api.test_engine_process import _cmdline, assert_engine_idle, start_cli_server, start_proc_server, stream_all
from vlserve import SamplingParams


@pytest.fixture(scope="module")
def dp_server(text_ckpt):
    from vlserve.config import EngineArgs

    served = start_proc_server(
        EngineArgs(model=text_ckpt, served_model_name="tiny-text", data_parallel_size=2, **TEXT_ENGINE_KW)
    )
    yield served
    served.close()


def replica_samples(served, name: str) -> dict[str, float]:
    """`vlserve:replica:<name>` samples of /metrics by engine index."""
    prefix = f'vlserve:replica:{name}{{engine="'
    return {k[len(prefix) :].split('"')[0]: v for k, v in served.metrics_labelled().items() if k.startswith(prefix)}


def test_dp2_equals_one_engine_and_uses_both_replicas(dp_server, server):
    convs = conversations(24)
    got = stream_all(dp_server.base_url, convs)
    assert got == stream_all(server.base_url, convs)
    assert len(set(got)) > 1 and all(got)
    pids = dp_server.engine.engine_pids
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert_engine_idle(dp_server)  # summed over the replicas: nothing held in either
    per_replica = replica_samples(dp_server, "generation_tokens_total")
    assert set(per_replica) == {"0", "1"} and min(per_replica.values()) > 0  # distinct prompts went to both
    assert sum(per_replica.values()) == dp_server.metrics()["vlserve:generation_tokens_total"]
    assert set(replica_samples(dp_server, "num_requests_running")) == {"0", "1"}


def test_stop_strings_and_n_cross_to_the_owning_replica(dp_server, server):
    msgs = conversations(5)[4]
    full = server.client.chat.completions.create(
        model="tiny-text", messages=msgs, temperature=0, max_tokens=16, extra_body=NO_EOS
    )
    stop = full.choices[0].message.content[3:6]
    kw = dict(model="tiny-text", messages=msgs, temperature=0, max_tokens=16, stop=[stop], n=2, extra_body=NO_EOS)
    got = dp_server.client.chat.completions.create(**kw)
    assert [c.message.content for c in got.choices] == [
        c.message.content for c in server.client.chat.completions.create(**kw).choices
    ]
    assert got.choices[0].finish_reason == "stop"
    assert_engine_idle(dp_server)
    assert dp_server.engine.engine_loop.router.open_requests == 0 and dp_server.engine.engine_loop.router.loads == [
        0,
        0,
    ]


def test_killed_replica_fails_requests_with_5xx_and_health_503(dp_server):
    """Runs last in this module: it kills one replica of the shared server; the whole server stops serving."""
    router = dp_server.engine.engine_loop.router
    convs = conversations(8)
    body = {"model": "tiny-text", "max_tokens": 900, "ignore_eos": True}

    async def in_flight() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=dp_server.base_url, timeout=60, trust_env=False) as client:
            tasks = [
                asyncio.create_task(client.post("/v1/chat/completions", json={**body, "messages": m})) for m in convs
            ]
            deadline = time.monotonic() + 30
            while min(router.loads) == 0:  # requests on both replicas
                assert time.monotonic() < deadline, f"requests did not reach both replicas: {router.loads}"
                await asyncio.sleep(0.05)
            os.kill(dp_server.engine.engine_pids[1], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    responses = asyncio.run(asyncio.wait_for(in_flight(), 60))
    for r in responses:
        assert r.status_code >= 500 and "engine process 1 exited" in r.json()["error"]["message"]
    assert dp_server.http.get("/health").status_code == 503
    assert dp_server.http.get("/metrics").status_code == 200


def test_one_image_in_16_requests_is_encoded_once_across_replicas(vl_ckpt, offline_vl):  # noqa: F811
    from vlserve.config import EngineArgs

    msgs = image_msg(data_url(png_bytes(5)))
    ref = offline_vl.chat(msgs, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    served = start_proc_server(
        EngineArgs(model=vl_ckpt, served_model_name="tiny-vl", data_parallel_size=2, **VL_ENGINE_KW)
    )
    try:

        async def run_all() -> list[str]:
            async with httpx.AsyncClient(base_url=served.base_url, timeout=120, trust_env=False) as client:
                body = {"model": "tiny-vl", "messages": msgs, "temperature": 0, "max_tokens": 8, **NO_EOS}
                rs = await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for _ in range(16)))
            return [r.json()["choices"][0]["message"]["content"] for r in rs]

        assert asyncio.run(run_all()) == [ref.outputs[0].text] * 16
        assert_engine_idle(served)
        assert served.metrics()["vlserve:encoder_runs_total"] == 1
        runs = replica_samples(served, "encoder_runs_total")
        assert sorted(runs.values()) == [0, 1]  # the other replica never saw the image
    finally:
        served.close()


def test_data_parallel_needs_the_engine_process(text_ckpt, capsys):
    from vlserve.cli import main

    assert (
        main(["serve", text_ckpt, "--port", str(free_port()), "--data-parallel-size", "2", "--no-engine-process"]) == 2
    )
    assert "--data-parallel-size 2 needs engine processes" in capsys.readouterr().err


@pytest.mark.slow
def test_server_exits_nonzero_when_a_replica_is_killed(text_ckpt, repo_root):
    proc, engines = start_cli_server(text_ckpt, repo_root, data_parallel_size=2)
    try:
        os.kill(engines[1], signal.SIGKILL)
        assert proc.wait(30) == 1
        deadline = time.monotonic() + 20  # the surviving replica goes too
        while os.path.exists(f"/proc/{engines[0]}") and "spawn_main" in _cmdline(engines[0]):
            assert time.monotonic() < deadline, "the other replica outlived its server"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
