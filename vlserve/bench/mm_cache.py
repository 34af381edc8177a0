"""Repeated-image scenario: encoder cache on vs off, in one run.

    python -m vlserve.bench.mm_cache --num-requests 32 --num-images 4 --image-size 448 --vision-depth 8 \
        --vision-width 512
    python -m vlserve.bench.mm_cache --family llava_next --vision-depth 8 --vision-width 256

Builds a random Qwen2-VL (or, with `--family llava_next`, LLaVA-NeXT: anyres tiles) checkpoint with a mid-size vision tower, sends R requests cycling over K distinct images
(prefix caching off in both runs, so only the encoder cache differs), and prints throughput, mean TTFT and ratios.
"Off" salts every item's hash with its request so no encoder output (or processed input) is ever reused.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np


def make_images(k: int, size: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)) for _ in range(k)]


def run(model: str, images, num_requests: int, output_len: int, cache_on: bool, mm_kwargs: dict) -> dict:
    from vlserve import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="float32",
        enable_prefix_caching=False,
        max_num_seqs=num_requests,
        mm_processor_kwargs=mm_kwargs,
        encoder_cache_size=None if cache_on else 16384,
    )
    if not cache_on:
        salt_hashes(llm)
    preprocess = time_preprocessing(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(["warm up"], sp, images=[[images[0]]], use_tqdm=False)
    prompts = [f"Describe picture {i}." for i in range(num_requests)]
    imgs = [[images[i % len(images)]] for i in range(num_requests)]
    preprocess[0] = 0.0
    graphs0 = compiled_graphs()
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, images=imgs, use_tqdm=False)
    dt = time.perf_counter() - t
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    m = llm.get_metrics()
    return {
        "seconds": dt,
        "req_per_s": num_requests / dt,
        "tok_per_s": num_requests * output_len / dt,
        "mean_ttft": sum(ttft) / len(ttft),
        "encoder_runs": m["vlserve:encoder_runs_total"],
        "preprocess_s": preprocess[0],
        "graphs_compiled": compiled_graphs() - graphs0,
        **forward_counts(m),
    }


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (one more during a timed run: it compiled mid-run)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def forward_counts(metrics: dict) -> dict:
    """The engine's decoder forwards so far (from `LLM.get_metrics()`): CUDA graph replays and forwards without one."""
    return {
        "graph_replays": int(metrics.get("vlserve:cuda_graph_replays_total", 0)),
        "eager_forwards": int(metrics.get("vlserve:eager_forwards_total", 0)),
    }


def time_preprocessing(llm) -> list[float]:
    """A one-item list that accumulates the seconds spent in the HF processor (decode, resize, patches)."""
    proc = llm.input_processor.mm_processor
    inner, spent = proc.process, [0.0]

    def process(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t

    proc.process = process
    return spent


def salt_hashes(llm) -> None:
    """Make every media item unique per call: the encoder cache and processor cache then never hit."""
    proc = llm.input_processor.mm_processor
    original = proc.process
    counter = iter(range(1 << 62))

    def process(*args, **kwargs):
        ids, feats = original(*args, **kwargs)
        salt = next(counter)
        for f in feats:
            f.mm_hash = f"{f.mm_hash}#{salt}"
        proc.clear_cache()
        return ids, feats

    proc.process = process


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a local Qwen2-VL or LLaVA-NeXT checkpoint; default: build a random one")
    p.add_argument(
        "--family",
        choices=("qwen2_vl", "llava_next"),
        default="qwen2_vl",
        help="which random checkpoint to build when --model is not given",
    )
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--num-images", type=int, default=4)
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--vision-depth", type=int, default=8)
    p.add_argument("--vision-width", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    model = args.model
    if model is None and args.family == "llava_next":
        from vlserve.demo.llava_checkpoints import build_llava_checkpoint

        model = build_llava_checkpoint(
            os.path.join(tempfile.mkdtemp(prefix="vlserve-mmbench-"), "model"),
            variant="llava_next",
            hidden_size=256,
            intermediate_size=512,
            num_layers=4,
            vision_width=args.vision_width,
            vision_depth=args.vision_depth,
            initializer_range=0.02,
            seed=args.seed,
        )
    elif model is None:
        from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

        model = os.path.join(tempfile.mkdtemp(prefix="vlserve-mmbench-"), "model")
        build_qwen2_vl_checkpoint(
            model,
            hidden_size=256,
            intermediate_size=512,
            num_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vision_depth=args.vision_depth,
            vision_embed_dim=args.vision_width,
            vision_num_heads=8,
            mrope_section=(8, 12, 12),
            initializer_range=0.02,
            seed=args.seed,
            max_pixels=args.image_size * args.image_size,
            min_pixels=(args.image_size // 2) ** 2,
        )
    images = make_images(args.num_images, args.image_size, args.seed)
    pixels = args.image_size * args.image_size
    qwen = _model_type(model).startswith("qwen")
    mm_kwargs = {"max_pixels": pixels, "min_pixels": pixels // 4} if qwen else None
    print(
        f"{args.num_requests} requests over {args.num_images} distinct {args.image_size}x{args.image_size} "
        f"images, vision tower depth {args.vision_depth} width {args.vision_width}, {args.output_len} tokens out"
    )
    on = run(model, images, args.num_requests, args.output_len, True, mm_kwargs)
    off = run(model, images, args.num_requests, args.output_len, False, mm_kwargs)
    for name, r in (("cache on ", on), ("cache off", off)):
        print(
            f"{name}: {r['req_per_s']:.2f} req/s, {r['tok_per_s']:.1f} tok/s, mean TTFT {r['mean_ttft']:.2f} s, "
            f"{r['encoder_runs']} encoder runs, {r['seconds']:.1f} s ({r['preprocess_s']:.1f} s in the HF processor), "
            f"{r['graphs_compiled']} graphs compiled during the run"
        )
    print(
        f"throughput ratio on/off: {on['req_per_s'] / off['req_per_s']:.2f}x; "
        f"mean TTFT ratio off/on: {off['mean_ttft'] / on['mean_ttft']:.2f}x"
    )


def _model_type(model_dir: str) -> str:
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f).get("model_type", "")


if __name__ == "__main__":
    main()
