"""Live video with the engine in its own process (`MPAsyncLLM`, what `vlserve serve` runs): a question's TTFT and
the bytes its request pickles across the process boundary, at 10 s / 60 s / 300 s of stream.

    .venv/bin/python -m benchmarks.live_video_engine_process                           # 10, 60, 300 s at 1 fps
    .venv/bin/python -m benchmarks.live_video_engine_process --seconds 4 8 --repeats 1 # a smoke run
    .venv/bin/python -m benchmarks.live_video_engine_process --resend-media            # for comparison

The stream, checkpoint and window are those of `benchmarks.live_video`. For each stream length it opens a session
(`AsyncVideoSessions`, as the server's video routes do), appends the stream a second at a time, waits for the last
prefill, then asks one question (max_tokens=1: the time to its output is its TTFT), --repeats times. A session's
items cross to the engine once (engine/session_media.py), so a question's request stays small however long the
window; `--resend-media` sends every item whole with every request instead (no session media store), to compare.
It prints, per length: the frames in the window, the prompt tokens, the median question TTFT, the question
request's pickled size and the mean time of one append. Figures only mean something on an otherwise idle machine.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from benchmarks.live_video import build, moving_square, stream_parser


def record_add_sizes(llm) -> dict[str, int]:
    """The pickled size of each AddRequests the client sends, by user request id."""
    from vlserve.engine.core_messages import AddRequests, encode

    sizes: dict[str, int] = {}
    send = llm.client.send

    def recording_send(msg, engine_index=0):
        if isinstance(msg, AddRequests):
            sizes[msg.user_request_id] = len(encode(msg))
        send(msg, engine_index)

    llm.client.send = recording_send
    return sizes


async def run_length(llm, sizes: dict[str, int], seconds: float, args) -> dict:
    from vlserve import SamplingParams
    from vlserve.engine.async_video_session import AsyncVideoSessions

    params = SamplingParams(temperature=0.0, max_tokens=1)
    frames = moving_square(int(seconds * args.fps), args.frame_size)
    step = max(1, int(args.fps))
    sessions = AsyncVideoSessions(llm, max_sessions=1, idle_timeout=3600)
    session = await sessions.create("bench", 0, fps=args.fps, max_frames=args.max_frames)
    append_s, ask_s, ask_bytes = [], [], []
    try:
        for start in range(0, len(frames), step):
            t0 = time.perf_counter()
            await session.append(list(frames[start : start + step]))
            append_s.append(time.perf_counter() - t0)
        for _ in range(args.repeats):
            prefill = session.engine.running_prefill(session.session.prefills.request_id)
            if prefill is not None:  # the question's time is its own, not the last append's prefill
                await asyncio.wait([asyncio.wrap_future(prefill)])
            t0 = time.perf_counter()
            prepared = await session.prepare_question(args.question)
            outputs = [out async for out in session.answer(prepared, params)]
            ask_s.append(time.perf_counter() - t0)
            asks = [r for r in sizes if r.startswith(f"{session.session_id}-ask-")]
            ask_bytes.append(sizes[max(asks, key=lambda r: int(r.rpartition("-")[2]))])
        window = session.session.stream.num_frames
    finally:
        await sessions.close(session.session_id)
    return {
        "seconds": seconds,
        "frames": window,
        "prompt": len(outputs[-1].prompt_token_ids),
        "ask_ms": 1000 * statistics.median(ask_s),
        "ask_kib": statistics.median(ask_bytes) / 1024,
        "append_ms": 1000 * statistics.mean(append_s),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = stream_parser(__doc__.splitlines()[0])
    parser.add_argument("--resend-media", action="store_true", help="send every item whole with every request")
    args = parser.parse_args(argv)

    from vlserve.config import EngineArgs
    from vlserve.engine.mp_async_llm import MPAsyncLLM

    path = build(args.variant, args.checkpoint_dir)
    llm = MPAsyncLLM.from_engine_args(EngineArgs(model=path, dtype="float32", max_model_len=4096, num_kv_blocks=2048))
    try:
        if args.resend_media:  # the sender passes every item through whole
            llm.engine_loop.session_media.outgoing = lambda engine, features: features
        sizes = record_add_sizes(llm)

        async def run_all() -> list[dict]:
            return [await run_length(llm, sizes, s, args) for s in args.seconds]

        rows = asyncio.run(run_all())
    finally:
        llm.shutdown()
    mode = "whole media every request" if args.resend_media else "session media sent once"
    print(f"live video via the engine process ({mode}), {args.variant}, {args.frame_size}px at {args.fps:g} fps")
    print(f"{'stream s':>8} {'frames':>6} {'prompt':>6} {'ask ms':>8} {'ask KiB':>8} {'append ms':>9}")
    for r in rows:
        print(
            f"{r['seconds']:>8g} {r['frames']:>6} {r['prompt']:>6} {r['ask_ms']:>8.1f} {r['ask_kib']:>8.1f} "
            f"{r['append_ms']:>9.1f}"
        )
    return rows


if __name__ == "__main__":
    main()
