"""`vlserve serve` as a subprocess: flags reach the engine and server (API key -> 401, waiting cap -> 503)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.api.conftest import free_port, serve_subprocess


@pytest.fixture(scope="module")
def cli_server(text_ckpt, repo_root):
    args = [
        text_ckpt,
        "--served-model-name",
        "cli-model",
        "other-name",
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--num-kv-blocks",
        "256",
        "--block-size",
        "16",
        "--max-num-seqs",
        "1",
        "--max-num-batched-tokens",
        "256",
        "--max-waiting-requests",
        "1",
        "--api-key",
        "sekrit",
        "--seed",
        "0",
        "--limit-mm-per-prompt",
        json.dumps({"image": 1}),
        "--log-level",
        "warning",
    ]
    with serve_subprocess(args, repo_root) as base:
        yield base


def test_api_key(cli_server):
    with httpx.Client(base_url=cli_server, timeout=60, trust_env=False) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
        r = c.post("/v1/chat/completions", json={"model": "cli-model", "messages": []})
        assert r.status_code == 401  # auth is checked before the body
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        ok = c.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert [m["id"] for m in ok.json()["data"]] == ["cli-model", "other-name"]

    import openai

    client = openai.OpenAI(base_url=f"{cli_server}/v1", api_key="sekrit", max_retries=0)
    r = client.chat.completions.create(model="other-name", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.model == "other-name" and r.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{cli_server}/v1", api_key="bad", max_retries=0).models.list()


def test_queue_full_gives_503_and_recovers(cli_server):
    auth = {"Authorization": "Bearer sekrit"}
    body = {
        "model": "cli-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=cli_server, timeout=60, headers=auth, trust_env=False) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as running:  # takes the only seat
            assert running.status_code == 200
            lines = running.iter_lines()  # keep a reference: a dropped iterator closes the response
            next(lines)
            with c.stream("POST", "/v1/chat/completions", json=body) as waiting:  # fills the waiting queue
                assert waiting.status_code == 200
                r = c.post("/v1/chat/completions", json={**body, "stream": False})
                assert r.status_code == 503, r.text
                assert "waiting queue is full" in r.json()["error"]["message"]
        deadline = time.monotonic() + 20  # the two hung-up streams are aborted as the server notices
        while (r := c.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})).status_code == 503:
            assert time.monotonic() < deadline, "the aborted streams never left the queue"
            time.sleep(0.1)
        assert r.status_code == 200
        m = c.get("/metrics").text
        assert "vlserve:num_aborted_requests_total 2.0" in m and "vlserve:num_requests_waiting 0.0" in m


def test_serve_without_model_explains_missing_demo(monkeypatch, tmp_path, capsys):
    """An install without the embedded checkpoint: `vlserve serve` with no MODEL exits 2 saying what to pass."""
    import vlserve.demo
    from vlserve.cli import main

    missing = str(tmp_path / "missing")
    monkeypatch.setitem(vlserve.demo.DEMO_MODELS, "vlserve-demo", (missing, "python -m training.train --out {dir}"))
    assert main(["serve", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "demo model" in err and "vlserve serve /path/to/model" in err


def test_cli_help_lists_vllm_flags(repo_root):
    proc = subprocess.run(
        [sys.executable, "-m", "vlserve.cli", "serve", "--help"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": repo_root},
    )
    assert proc.returncode == 0
    for flag in (
        "--served-model-name",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--kv-cache-memory-bytes",
        "--num-kv-blocks",
        "--block-size",
        "--limit-mm-per-prompt",
        "--allowed-local-media-path",
        "--allowed-media-domains",
        "--api-key",
        "--speculative-config",
        "--max-waiting-requests",
        "--max-num-encoder-input-tokens",
        "--seed",
        "--dtype",
    ):
        assert flag in proc.stdout, flag


def test_serve_flags_map_to_engine_args_and_server_config():
    from vlserve.cli import build_parser, serve_config_from_args

    args = build_parser().parse_args(
        [
            "serve",
            "/models/x",
            "--served-model-name",
            "a",
            "b",
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "4096",
            "--max-num-seqs",
            "7",
            "--max-num-batched-tokens",
            "1024",
            "--kv-cache-memory-bytes",
            "123456",
            "--num-kv-blocks",
            "99",
            "--block-size",
            "32",
            "--limit-mm-per-prompt",
            '{"image":4,"video":1}',
            "--allowed-local-media-path",
            "/data",
            "--allowed-media-domains",
            "a.com,b.org",
            "c.net",
            "--api-key",
            "k",
            "--speculative-config",
            '{"method":"ngram","num_speculative_tokens":3}',
            "--max-waiting-requests",
            "5",
            "--seed",
            "11",
            "--port",
            "9000",
            "--host",
            "127.0.0.1",
            "--max-num-encoder-input-tokens",
            "300",
        ]
    )
    engine, server = serve_config_from_args(args)
    assert (engine.model, engine.dtype, engine.max_model_len, engine.max_num_seqs) == ("/models/x", "bfloat16", 4096, 7)
    assert (engine.max_num_batched_tokens, engine.kv_cache_memory_bytes, engine.num_kv_blocks) == (1024, 123456, 99)
    assert engine.block_size == 32 and engine.seed == 11 and engine.max_waiting_requests == 5
    assert engine.max_num_encoder_input_tokens == 300
    assert engine.limit_mm_per_prompt == {"image": 4, "video": 1}
    assert engine.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert engine.served_model_name == "a" and server.served_model_names == ["a", "b"]
    assert server.api_key == "k" and server.media.allowed_local_media_path == "/data"
    assert server.media.allowed_media_domains == ["a.com", "b.org", "c.net"]
    assert (args.host, args.port) == ("127.0.0.1", 9000)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--limit-mm-per-prompt", "not json"])
