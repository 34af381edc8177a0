"""AsyncLLM directly (the server's engine, driven from the test's own event loop)."""

from __future__ import annotations

import asyncio
import time

import pytest

from vlserve import SamplingParams


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def test_generate_is_cumulative_and_matches_offline(server, offline_llm):
    prompt = "the quick brown fox jumps over"
    ref = offline_llm.generate(prompt, greedy(20), use_tqdm=False)[0].outputs[0]

    async def run():
        return [out async for out in server.engine.generate(prompt, greedy(20), "async-cumulative")]

    outs = asyncio.run(run())
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert outs[-1].outputs[0].text == ref.text and outs[-1].outputs[0].token_ids == ref.token_ids
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] == 20
    for a, b in zip(outs, outs[1:]):
        assert b.outputs[0].text.startswith(a.outputs[0].text)


def test_errors_surface_to_the_caller(server):
    async def run(prompt, params):
        return [o async for o in server.engine.generate(prompt, params)]

    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(run(list(range(5, 600)) * 2, greedy(2)))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        asyncio.run(run([10**9], greedy(2)))

    async def duplicate():
        first = server.engine.generate("hello", greedy(50), "dup-id")
        await first.__anext__()
        try:
            with pytest.raises(ValueError, match="already in use"):
                [o async for o in server.engine.generate("hello", greedy(2), "dup-id")]
        finally:
            await first.aclose()

    asyncio.run(duplicate())
    server.wait_idle()


def test_closing_the_iterator_aborts(server):
    async def run():
        gen = server.engine.generate("one two three", greedy(200), "async-close")
        got = [await gen.__anext__() for _ in range(2)]
        await gen.aclose()
        return got

    got = asyncio.run(run())
    assert not got[-1].finished
    server.wait_idle()
    server.engine.engine.check_integrity()


def test_closing_an_n2_stream_aborts_both_sequences(server):
    async def run():
        gen = server.engine.generate(
            "four five six",
            SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=200, ignore_eos=True),
            "async-n2-close",
        )
        first = await gen.__anext__()
        await gen.aclose()
        return first

    first = asyncio.run(run())
    assert len(first.outputs) == 2 and not first.finished
    server.wait_idle()
    assert not server.engine.engine_loop.output_processor.parents
    server.engine.engine.check_integrity()


def test_abort_by_id_ends_stream_with_abort(server):
    async def run():
        outs = []
        async for out in server.engine.generate("red green blue", greedy(200), "async-abort-id"):
            outs.append(out)
            if len(outs) == 2:
                server.engine.abort("async-abort-id")
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 200
    server.wait_idle()


def test_event_loop_is_not_blocked_by_model_compute(server):
    """The loop keeps ticking while the engine thread computes: ticks interleave with streamed outputs.
    (No wall-clock threshold: the worst gap is printed as a diagnostic only.)"""

    async def run():
        gaps, ticks, stop = [], [0], asyncio.Event()
        seen_at_output: list[int] = []

        async def ticker():
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0)
                ticks[0] += 1
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        prompts = [f"question {i}: " + "where is the red circle " * 8 for i in range(8)]

        async def collect(p):
            outs = []
            async for o in server.engine.generate(p, greedy(100)):
                seen_at_output.append(ticks[0])
                outs.append(o)
            return outs

        results = await asyncio.gather(*(collect(p) for p in prompts))
        stop.set()
        await task
        return max(gaps), seen_at_output, results

    worst, seen, results = asyncio.run(run())
    print(f"worst loop gap {worst:.4f}s")
    assert all(r[-1].finished for r in results)
    # One step streams one output per request (8). If compute ran on the event loop, the ticker could not run
    # between steps; here it must have run between at least half of them.
    num_steps = len(seen) / 8
    assert len(set(seen)) >= num_steps / 2, "the event loop did not run between engine steps"
