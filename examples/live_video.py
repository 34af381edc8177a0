"""A live video session on the demo model: frames of a moving shape arrive two at a time, and a question is asked at
two moments; each answer sees the last `--window` frames only.

python examples/live_video.py               # the shape moves right, then turns and moves down
python examples/live_video.py --check       # also asks one ordinary request per moment with the same frames
"""

import argparse
import dataclasses
import random
import time

QUESTION = "Which direction does the {shape} move?"


def moving_shape_frames(steps: int = 8) -> tuple[list, str]:
    """A clip whose shape moves right for `steps` frames, then down for `steps` frames: (RGB PIL frames, its kind)."""
    from vlserve.demo.world import render_video, sample_video

    scene = sample_video(random.Random(5), num_frames=2)  # its shape, colors and style; the path is set here
    w, h = scene.width, scene.height
    right = [(0.32 + 0.3 * i / (steps - 1), 0.32) for i in range(steps)]
    down = [(0.62, 0.32 + 0.3 * (i + 1) / steps) for i in range(steps)]
    centers = tuple((x * w, y * h) for x, y in right + down)
    return render_video(dataclasses.replace(scene, centers=centers)), scene.shape.kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Qwen2-VL-family checkpoint (default: the demo model)")
    parser.add_argument("--window", type=int, default=8, help="frames a question sees (max_frames)")
    parser.add_argument("--check", action="store_true", help="compare with one request per moment")
    args = parser.parse_args()

    from vlserve import LLM, SamplingParams

    frames, kind = moving_shape_frames()
    question = QUESTION.format(shape=kind)
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    llm = LLM(args.model, dtype="float32")
    answers = []
    with llm.open_video_session(fps=2, max_frames=args.window) as session:
        for i in range(0, len(frames), 2):
            session.append(frames[i : i + 2])  # processed, encoded and prefilled as they arrive
            if i + 2 in (args.window, len(frames)):  # two moments: after the turn's first half and at the end
                t = time.perf_counter()
                answer = session.ask(question, greedy).outputs[0].text
                answers.append((i + 2, answer))
                print(f"after {i + 2:2d} frames: {question} -> {answer!r} ({(time.perf_counter() - t) * 1e3:.0f} ms)")
    if args.check:
        for seen, answer in answers:
            window = frames[max(0, seen - args.window) : seen]
            video = [{"type": "video", "video": window}, {"type": "text", "text": question}]
            out = llm.chat([{"role": "user", "content": video}], greedy, use_tqdm=False)[0].outputs[0].text
            print(f"one request with frames {seen - len(window)}-{seen - 1}: {out!r} (same: {out == answer})")


if __name__ == "__main__":
    main()
