"""`vlserve serve --tensor-parallel-size 2`: the engine process starts two rank processes; the official openai client
gets what the one-rank offline engine gives; killing a rank fails the request with a clear 5xx error and the server
exits non-zero instead of hanging."""

from __future__ import annotations

import os
import signal

import pytest

from tests.api.test_engine_process import _cmdline, start_cli_server
from vlserve import LLM, SamplingParams

pytestmark = pytest.mark.slow


def _rank_pids(engine_pid: int) -> list[int]:
    children = open(f"/proc/{engine_pid}/task/{engine_pid}/children").read().split()
    return [int(c) for c in children if "spawn_main" in _cmdline(c)]


def test_tp2_server_matches_one_rank_then_a_killed_rank_stops_it(text_ckpt, repo_root):
    import openai

    prompt, chat = "the quick brown fox", [{"role": "user", "content": "Say something."}]
    offline = LLM(text_ckpt, dtype="float32", max_model_len=1024, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want_text = offline.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].text
    want_chat = offline.chat(chat, greedy, use_tqdm=False)[0].outputs[0].text

    proc, (engine,) = start_cli_server(text_ckpt, repo_root, extra_args=("--tensor-parallel-size", "2"))
    try:
        ranks = _rank_pids(engine)
        assert len(ranks) == 2, f"expected two rank processes under the engine, got {ranks}"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{proc.port}/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        extra = {"ignore_eos": True}
        got = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, extra_body=extra)
        assert got.choices[0].text == want_text
        got = client.chat.completions.create(model=model, messages=chat, max_tokens=16, temperature=0, extra_body=extra)
        assert got.choices[0].message.content == want_chat

        os.kill(ranks[1], signal.SIGKILL)
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
        if not (failed.value.status_code >= 500 and "tensor-parallel rank 1" in str(failed.value)):
            proc.kill()
            log = proc.communicate()[0]
            pytest.fail(f"{failed.value!r} {failed.value.body!r}; server said:\n{log[:3000]}\n...\n{log[-1500:]}")
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
