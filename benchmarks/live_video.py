"""Live video: time to first token of a question at 10 s / 60 s / 300 s of stream, session vs one request.

    .venv/bin/python -m benchmarks.live_video                            # 10, 60, 300 s at 1 fps, tiny Qwen2-VL
    .venv/bin/python -m benchmarks.live_video --seconds 4 8 --repeats 1  # a smoke run (the test's size)
    .venv/bin/python -m benchmarks.live_video --variant qwen2_5_vl --fps 2 --frame-size 112

Builds (once, under --checkpoint-dir) a random tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL with its real HF processor
and feeds it a generated stream: a bright square moving over a still, noisy background, --frame-size pixels square,
at --fps. For each stream length it opens a session (`LLM.open_video_session`, window --max-frames frames, less
--window-slack on overflow), appends
the stream a second at a time, then asks one question (max_tokens=1: the ask's time is its TTFT), --repeats times;
then it sends the same question as one ordinary request carrying the window's frames as one video (the oracle of
tests/multimodal/test_video_session.py), each repeat after clearing the processor, prefix and encoder caches, as a
request with new media finds them. It prints, per length: the frames in the
window, the prompt tokens, the question's computed tokens (prompt minus prefix-cache hits), the median TTFT of the
session's question and of the one request, their ratio, and the mean time of one append (preprocess + prefill of
the grown prefix). Figures on this machine only mean something with the machine otherwise idle.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np


def moving_square(num_frames: int, size: int, seed: int = 0) -> np.ndarray:
    """[num_frames, size, size, 3] uint8: a white square crossing a fixed noisy background, one step a frame."""
    rng = np.random.RandomState(seed)
    background = rng.randint(0, 100, (size, size, 3), dtype=np.uint8)
    frames = np.repeat(background[None], num_frames, axis=0)
    side = max(4, size // 5)
    for i in range(num_frames):
        x = (3 * i) % (size - side)
        y = (i // 7 * 2) % (size - side)
        frames[i, y : y + side, x : x + side] = 255
    return frames


def build(variant: str, checkpoint_dir: str) -> str:
    path = os.path.join(checkpoint_dir, f"live-{variant}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    if variant == "qwen3_vl":
        from tests.support.qwen3_vl_checkpoints import build_qwen3_vl_checkpoint

        return build_qwen3_vl_checkpoint(path)
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    return build_qwen2_vl_checkpoint(path, variant=variant)


def run_length(llm, seconds: float, args) -> dict:
    from vlserve import SamplingParams
    from vlserve.multimodal.media import LoadedVideo

    params = SamplingParams(temperature=0.0, max_tokens=1)
    frames = moving_square(int(seconds * args.fps), args.frame_size)
    step = max(1, int(args.fps))
    append_s, ask_s, oneshot_s = [], [], []
    with llm.open_video_session(fps=args.fps, max_frames=args.max_frames, window_slack=args.window_slack) as session:
        for start in range(0, len(frames), step):
            t0 = time.perf_counter()
            session.append(list(frames[start : start + step]))
            append_s.append(time.perf_counter() - t0)
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            answer = session.ask(args.question, params)
            ask_s.append(time.perf_counter() - t0)
        window = session.stream.window_frames()
    video = LoadedVideo(window, args.fps, args.fps, list(range(len(window))), len(window))
    turn = {"role": "user", "content": [{"type": "video", "video": video}, {"type": "text", "text": args.question}]}
    for _ in range(args.repeats):
        llm.input_processor.mm_processor.clear_cache()  # the one request pays its preprocessing, as a new one does
        llm.engine.scheduler.kv.reset_prefix_cache()
        llm.engine.scheduler.encoder_cache.reset()
        t0 = time.perf_counter()
        llm.chat([turn], params, use_tqdm=False)
        oneshot_s.append(time.perf_counter() - t0)
    return {
        "seconds": seconds,
        "frames": len(window),
        "prompt": len(answer.prompt_token_ids),
        "computed": len(answer.prompt_token_ids) - answer.num_cached_tokens,
        "ask_ms": 1000 * statistics.median(ask_s),
        "oneshot_ms": 1000 * statistics.median(oneshot_s),
        "append_ms": 1000 * statistics.mean(append_s),
    }


def stream_parser(description: str) -> argparse.ArgumentParser:
    """The flags of the stream, checkpoint and window (shared with benchmarks.live_video_engine_process)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--variant", default="qwen2_vl", choices=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
    parser.add_argument("--seconds", type=float, nargs="+", default=[10, 60, 300])
    parser.add_argument("--fps", type=float, default=1.0)
    parser.add_argument("--frame-size", type=int, default=56)
    parser.add_argument("--max-frames", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--question", default="Where is the square going?")
    parser.add_argument("--checkpoint-dir", default=os.path.join(tempfile.gettempdir(), "vlserve-live-video"))
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    parser = stream_parser(__doc__.splitlines()[0])
    parser.add_argument("--window-slack", type=int, default=0, help="frames dropped below --max-frames at once")
    args = parser.parse_args(argv)

    from vlserve import LLM

    path = build(args.variant, args.checkpoint_dir)
    llm = LLM(path, dtype="float32", max_model_len=4096, num_kv_blocks=2048)
    llm.open_video_session(fps=args.fps).close()  # warm-up: the processors and the first forward
    rows = [run_length(llm, s, args) for s in args.seconds]
    print(f"live video, {args.variant}, {args.frame_size}px frames at {args.fps:g} fps, window {args.max_frames}")
    print(
        f"{'stream s':>8} {'frames':>6} {'prompt':>6} {'computed':>8} {'ask ms':>8} {'1-req ms':>8} {'ratio':>6} "
        f"{'append ms':>9}"
    )
    for r in rows:
        print(
            f"{r['seconds']:>8g} {r['frames']:>6} {r['prompt']:>6} {r['computed']:>8} {r['ask_ms']:>8.1f} "
            f"{r['oneshot_ms']:>8.1f} {r['oneshot_ms'] / r['ask_ms']:>6.1f} {r['append_ms']:>9.1f}"
        )
    llm.check_integrity()
    return rows


if __name__ == "__main__":
    main()
