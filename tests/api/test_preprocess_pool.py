"""Preprocessing (media decoding, resizing, the HF processor) runs in a pool of `--mm-preprocess-workers` threads,
so the event loop answers while every worker is busy; and the processor cache's counters move on /metrics in every
process layout `vlserve serve` has (engine thread, engine process, data-parallel engine processes)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.api.conftest import serve_subprocess
from tests.api.test_api_media import data_url, image_msg, png_bytes
from tests.api.test_engine_process import start_proc_server

DEMO_KW = dict(num_kv_blocks=128, max_num_seqs=4)
DEMO_FLAGS = ["--num-kv-blocks", "128", "--max-num-seqs", "4", "--log-level", "warning"]


def test_the_flag_sizes_the_pool():
    from vlserve.cli import build_parser, serve_config_from_args

    args, _ = serve_config_from_args(build_parser().parse_args(["serve", "--mm-preprocess-workers", "3"]))
    assert args.mm_preprocess_workers == 3
    args, _ = serve_config_from_args(build_parser().parse_args(["serve"]))
    assert args.mm_preprocess_workers == 4
    args, _ = serve_config_from_args(
        build_parser().parse_args(["serve", "--mm-processor-kwargs", '{"use_fast": false}'])
    )
    assert args.mm_processor_kwargs == {"use_fast": False}


def test_the_loop_answers_while_every_preprocess_worker_is_busy():
    """Three image requests on a pool of two: two sit inside the HF processor at once (held there), the third
    waits for a worker, and /health and /v1/models answer meanwhile; released, all three complete."""
    from vlserve.config import EngineArgs

    served = start_proc_server(EngineArgs(model=None, served_model_name="demo", mm_preprocess_workers=2, **DEMO_KW))
    try:
        assert served.engine.num_input_workers == 2
        mm = served.engine.input_processor.mm_processor
        inner, threads = mm.process_image, []
        entered, release = threading.Semaphore(0), threading.Event()

        def held(image, image_kwargs=None):
            threads.append(threading.current_thread().name)
            entered.release()
            assert release.wait(60)
            return inner(image, image_kwargs)

        mm.process_image = held
        try:
            with ThreadPoolExecutor(3) as clients:
                futures = [
                    clients.submit(
                        served.client.chat.completions.create,
                        model="demo",
                        max_tokens=2,
                        messages=image_msg(data_url(png_bytes(20 + i))),
                    )
                    for i in range(3)
                ]
                assert entered.acquire(timeout=60) and entered.acquire(timeout=60)
                assert not entered.acquire(timeout=1.0)  # the third waits: the pool is bounded at two
                start = time.monotonic()
                assert served.http.get("/health").status_code == 200
                assert served.http.get("/v1/models").status_code == 200
                assert time.monotonic() - start < 5.0
                release.set()
                results = [f.result(120) for f in futures]
        finally:
            release.set()
            del mm.process_image  # back to the class's method
        assert [r.usage.completion_tokens for r in results] == [2, 2, 2]
        assert len(threads) == 3 and all(name.startswith("vlserve-preprocess") for name in threads)
        assert len(set(threads)) <= 2
    finally:
        served.close()


LAYOUTS = {
    "engine-thread": ["--no-engine-process"],
    "engine-process": [],
    "data-parallel-2": pytest.param(["--data-parallel-size", "2"], marks=pytest.mark.slow),
}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_processor_cache_counters_move_on_metrics(layout, repo_root):
    """The same image twice: one miss, then one hit, on /metrics of a real `vlserve serve` of the demo model; a new
    image is a second miss. The counters are the API process's (where the media are processed): no engine replica
    reports a processor cache of its own."""
    args = ["vlserve-demo", "--served-model-name", "demo", "--mm-preprocess-workers", "2", *DEMO_FLAGS, *layout]
    with serve_subprocess(args, repo_root, timeout=240) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        http = httpx.Client(base_url=base, timeout=60, trust_env=False)
        try:

            def counters() -> tuple[float, float]:
                lines = dict(
                    line.rsplit(" ", 1)
                    for line in http.get("/metrics").text.splitlines()
                    if line and not line.startswith("#")
                )
                assert not [k for k in lines if k.startswith("vlserve:replica:mm_processor")]
                return (
                    float(lines["vlserve:mm_processor_cache_hits_total"]),
                    float(lines["vlserve:mm_processor_cache_misses_total"]),
                )

            assert counters() == (0, 0)
            same = image_msg(data_url(png_bytes(31)))
            for expected in ((0, 1), (1, 1)):
                r = client.chat.completions.create(model="demo", messages=same, max_tokens=2, temperature=0)
                assert r.usage.completion_tokens >= 1
                assert counters() == expected
            client.chat.completions.create(model="demo", messages=image_msg(data_url(png_bytes(32))), max_tokens=2)
            assert counters() == (1, 2)
        finally:
            client.close()
            http.close()
