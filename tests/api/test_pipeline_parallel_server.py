"""`vlserve serve --pipeline-parallel-size 2`: the engine process starts two stage processes; the openai client gets
what the one-process offline engine gives; a stage killed mid-generation fails the requests in flight (plain and
streamed) with a clear 5xx error naming the stage, /health stops answering 200, and the server exits non-zero
instead of hanging."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from tests.api.test_engine_process import start_cli_server
from tests.api.test_tensor_parallel_server import _rank_pids
from vlserve import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_pp2_server_matches_offline_then_a_stage_killed_mid_generation_fails_cleanly(text_ckpt, repo_root):
    import openai

    prompt = "the quick brown fox"
    offline = LLM(text_ckpt, dtype="float32", max_model_len=1024, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want_text = offline.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].text
    offline.shutdown()

    proc, (engine,) = start_cli_server(text_ckpt, repo_root, extra_args=("--pipeline-parallel-size", "2"))
    try:
        stages = _rank_pids(engine)
        assert len(stages) == 2, f"expected two stage processes under the engine, got {stages}"
        base_url = f"http://127.0.0.1:{proc.port}"
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        got = client.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        assert got.choices[0].text == want_text

        body = {"model": model, "prompt": prompt, "max_tokens": 900, "temperature": 0, "ignore_eos": True}

        async def in_flight() -> tuple[httpx.Response, str]:
            async with httpx.AsyncClient(base_url=base_url, timeout=60, trust_env=False) as http:
                plain = asyncio.create_task(http.post("/v1/completions", json=body))
                async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                    assert resp.status_code == 200
                    lines = resp.aiter_lines()
                    assert '"text"' in await anext(lines) or '"text"' in await anext(lines)
                    os.kill(stages[1], signal.SIGKILL)  # the last stage: the first one blocks in its hand-over
                    rest = "\n".join([line async for line in lines])
                return await plain, rest

        plain, rest = asyncio.run(asyncio.wait_for(in_flight(), 60))
        message = (
            plain.json()["error"]["message"]
            if plain.headers.get("content-type", "").startswith("application/json")
            else plain.text
        )
        if not (plain.status_code >= 500 and "pipeline stage 1" in message):
            proc.kill()
            pytest.fail(f"{plain.status_code} {message!r}; server said:\n{proc.communicate()[0][-3000:]}")
        assert '"error"' in rest and "pipeline stage 1" in rest
        try:  # the server is on its way out: it answers 503 or no longer at all
            assert httpx.get(f"{base_url}/health", timeout=5, trust_env=False).status_code == 503
        except httpx.TransportError:
            pass
        assert proc.wait(30) == 1
        assert all(
            not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
            for pid in stages
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
