"""An idle P2P producer frees its kept blocks on its own: the server's engine loops (the in-process
engine thread and the engine-core process) keep polling the connector while blocks are kept, with nothing else to
run; here the send timeout frees them (no consumer ever reads)."""

from __future__ import annotations

import asyncio
import time

import pytest

from vlserve import SamplingParams
from vlserve.config import EngineArgs, KVTransferConfig


def _args(model_dir):
    cfg = KVTransferConfig("P2PConnector", "kv_producer", {"send_timeout_s": 0.5})
    return EngineArgs(
        model=model_dir,
        dtype="float32",
        num_kv_blocks=32,
        max_model_len=96,
        block_size=4,
        seed=0,
        kv_transfer_config=cfg,
    )


def _prefill(engine, rid):
    sp = SamplingParams(max_tokens=1, temperature=0.0, kv_transfer_params={"do_remote_decode": True})

    async def run():
        return [o async for o in engine.generate({"prompt_token_ids": list(range(5, 25))}, sp, rid)][-1]

    return asyncio.run(run())


def _wait(until, limit_s=10.0):
    t0 = time.monotonic()
    while not until():
        assert time.monotonic() - t0 < limit_s
        time.sleep(0.02)


def test_async_engine_thread_frees_kept_blocks_when_idle(qwen2_dir, mooncake):
    from vlserve.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(_args(qwen2_dir))
    try:
        out = _prefill(engine, "idle-1")
        assert out.kv_transfer_params["do_remote_prefill"]
        sched = engine.engine.scheduler
        assert sched.kv_transfer.kept_blocks or sched.kv.usage == 0  # (may already be gone if the machine is very slow)
        _wait(lambda: not sched.kv_transfer.kept_blocks and sched.kv.usage == 0)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_engine_process_frees_kept_blocks_when_idle(qwen2_dir, mooncake):
    from vlserve.engine.mp_async_llm import MPAsyncLLM

    engine = MPAsyncLLM.from_engine_args(_args(qwen2_dir))
    try:
        out = _prefill(engine, "idle-2")
        assert out.kv_transfer_params["do_remote_prefill"]
        _wait(lambda: engine.get_metrics()["vlserve:kv_cache_usage"] == 0)
    finally:
        engine.shutdown()
