"""Questions about a video clip, offline through `LLM.chat` or through a running server (`--base-url`).

python examples/video_qa.py                      # renders a clip of a moving shape with PyAV
python examples/video_qa.py --video clip.mp4     # or your own file
python examples/video_qa.py --base-url http://127.0.0.1:8000/v1
"""

import argparse
import base64
import os
import random
import tempfile
import time

QUESTIONS = ["Which direction does the {shape} move?", "What color is the moving shape?", "Describe the video."]


def make_clip(path: str) -> tuple[str, str]:
    from vlserve.demo.world import render_video, sample_video, write_mp4

    scene = sample_video(random.Random(3))
    write_mp4(render_video(scene), path)
    return path, scene.shape.kind


def ask_offline(model: str | None, video_path: str, questions: list[str]) -> None:
    from vlserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, dtype="float32")
    print(f"loaded in {time.perf_counter() - t0:.1f} s")
    with open(video_path, "rb") as f:
        data = f.read()
    sp = SamplingParams(temperature=0.0, max_tokens=48)
    for q in questions:
        t = time.perf_counter()
        out = llm.chat(
            [{"role": "user", "content": [{"type": "video", "video": data}, {"type": "text", "text": q}]}],
            sp,
            use_tqdm=False,
        )[0]
        print(
            f"{q} -> {out.outputs[0].text!r}  ({time.perf_counter() - t:.2f} s, {len(out.outputs[0].token_ids)} tokens)"
        )
    m = llm.get_metrics()
    print(
        "encoder cache: "
        + ", ".join(
            f"{k.split(':')[1]}={m[k]:g}"
            for k in (
                "vlserve:encoder_runs_total",
                "vlserve:encoder_cache_hits_total",
                "vlserve:encoder_cache_misses_total",
                "vlserve:mm_processor_cache_hits_total",
                "vlserve:prefix_cache_hits_total",
            )
        )
    )


def ask_server(base_url: str, api_key: str, video_path: str, questions: list[str]) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key)
    model = client.models.list().data[0].id
    with open(video_path, "rb") as f:
        url = "data:video/mp4;base64," + base64.b64encode(f.read()).decode()
    for q in questions:
        t = time.perf_counter()
        reply = client.chat.completions.create(
            model=model,
            max_tokens=48,
            temperature=0,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": q}],
                }
            ],
        )
        print(
            f"{q} -> {reply.choices[0].message.content!r}  ({time.perf_counter() - t:.2f} s, "
            f"{reply.usage.completion_tokens} tokens, {reply.usage.prompt_tokens} prompt tokens)"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--video", help="a video file (default: render a clip)")
    p.add_argument("--model", help="local checkpoint for offline use (default: the demo model)")
    p.add_argument("--base-url", help="ask a running server instead, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="EMPTY")
    args = p.parse_args()
    shape = "shape"
    video = args.video
    if video is None:
        video, shape = make_clip(os.path.join(tempfile.mkdtemp(), "clip.mp4"))
        print(f"rendered {video}")
    questions = [q.format(shape=shape) for q in QUESTIONS]
    if args.base_url:
        ask_server(args.base_url, args.api_key, video, questions)
    else:
        ask_offline(args.model, video, questions)


if __name__ == "__main__":
    main()
