"""Adapters load off the step loop: while a slow adapter load is under way (its file read blocked until the test
lets it go), a running request keeps producing tokens, the load then settles the caller's `add_lora`, and a
request naming the new adapter runs with it. A load that fails reaches its caller as a ValueError."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.lora.lora_helpers import ALL, make_adapter
from vlserve import SamplingParams
from vlserve.config import EngineArgs
from vlserve.engine.async_llm import AsyncLLM
from vlserve.lora import LoRARequest


@pytest.fixture(scope="module")
def adapter(checkpoint, tmp_path_factory):
    model_dir, _ = checkpoint("qwen2")
    return model_dir, make_adapter(model_dir, tmp_path_factory.mktemp("slow") / "a", ALL, r=4, seed=5)[0]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_slow_load_does_not_stall_running_requests(adapter, monkeypatch, tmp_path, async_scheduling):
    import vlserve.lora.model_manager as mm

    model_dir, adapter_dir = adapter
    release, reading = threading.Event(), threading.Event()
    real_read = mm.read_peft_files

    def slow_read(path):
        reading.set()
        assert release.wait(30), "the test never released the load: no tokens arrived while it was read"
        return real_read(path)

    monkeypatch.setattr(mm, "read_peft_files", slow_read)
    engine = AsyncLLM.from_engine_args(
        EngineArgs(
            model=model_dir,
            dtype="float32",
            num_kv_blocks=128,
            enable_lora=True,
            max_lora_rank=8,
            async_scheduling=async_scheduling,
        )
    )

    async def run() -> tuple[int, list[int], list[int]]:
        tokens_during_load, base = 0, []

        async def stream() -> None:
            nonlocal tokens_during_load, base
            params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            start = None  # tokens when the read was seen under way
            async for out in engine.generate([5, 6, 7, 8], params, request_id="running"):
                n = len(out.outputs[0].token_ids)
                if reading.is_set() and not release.is_set():
                    start = n if start is None else start
                    tokens_during_load = n - start
                    if tokens_during_load >= 5:
                        release.set()  # five steps ran while the adapter was being read: let the load finish
            base = list(out.outputs[0].token_ids[:4])

        task = asyncio.create_task(stream())
        await asyncio.sleep(0.2)
        load = asyncio.create_task(engine.add_lora(LoRARequest("slow", 1, adapter_dir)))
        await asyncio.wait_for(asyncio.shield(load), 30)
        assert load.result() is True
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        outs = [
            out
            async for out in engine.generate(
                [5, 6, 7, 8], params, request_id="with-adapter", lora_request=LoRARequest("slow", 1, adapter_dir)
            )
        ]
        final = outs[-1]
        await task
        with pytest.raises(ValueError, match="missing adapter_config.json"):
            await engine.add_lora(LoRARequest("bad", 2, str(tmp_path)))
        return tokens_during_load, base, list(final.outputs[0].token_ids)

    try:
        during, base, with_adapter = asyncio.run(run())
    finally:
        engine.shutdown()
    assert during >= 5 and len(with_adapter) == 4 and with_adapter != base
