"""Offline batch inference: `LLM(...).generate(prompts, images=...)` on rendered shape pictures.

python examples/offline_batch.py [--model DIR]      # default: the embedded demo model
"""

import argparse
import random
import time

from vlserve import LLM, SamplingParams
from vlserve.demo.world import render_image, sample_scene


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="local Qwen2-VL checkpoint (default: the demo model)")
    p.add_argument("--num-images", type=int, default=6)
    args = p.parse_args()
    rng = random.Random(0)
    scenes = [sample_scene(rng) for _ in range(args.num_images)]
    images = [render_image(s) for s in scenes]
    questions = ["Describe the image.", "How many shapes are there?", "What shape is in the image?"]
    prompts = [questions[i % len(questions)] for i in range(len(images))]
    llm = LLM(args.model, dtype="float32")
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=48), images=[[im] for im in images])
    dt = time.perf_counter() - t
    for prompt, img, out in zip(prompts, images, outs):
        print(f"[{img.width}x{img.height}] {prompt} -> {out.outputs[0].text!r}")
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{len(outs)} requests, {n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s)")


if __name__ == "__main__":
    main()
