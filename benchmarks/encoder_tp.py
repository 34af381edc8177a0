"""Vision-tower images/s over two tensor-parallel CPU ranks in each `mm_encoder_tp_mode`, against one rank.

The tower has Qwen2-VL-2B's vision shapes by default (depth 32, width 1280, 16 heads, MLP ratio 4, patch 14,
merge 2, out 1536; seeded random weights, normal std 0.02, the same on every rank), packed as the model runner
packs towers. One step's images: `--images` of `--sizes` pixels a side (cycled through the sizes), seeded normal
pixel rows. Three runs, each process with one intra-op thread (`--threads`):
- TP 1: one process encodes every image in one tower call (what a single rank does today);
- TP 2 weights: two gloo ranks, the tower's blocks split over them (`vlserve.models.tower_sharding`: heads and MLP
  width, two all-reduces a block), every image through both;
- TP 2 data: two gloo ranks, the images split by size (`vlserve.worker.encoder_split.encode_across_ranks`, the
  function the runner calls), each rank encodes its share and the embeddings are all-gathered.
Each run: one warm-up call, then `--iters` timed calls between barriers; printed: the median seconds of a step, the
images/s, and the speed-up over TP 1.

    python -m benchmarks.encoder_tp [--depth 32] [--width 1280] [--heads 16] [--images 8] [--sizes 448 224]
        [--iters 3] [--dtype bfloat16] [--threads 1]
    python -m benchmarks.encoder_tp --smoke     # a 2-block, 256-wide tower, 4 small images, 1 iteration
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from torch import nn

PATCH, TEMPORAL, MERGE = 14, 2, 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=32)
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--out-dim", type=int, default=1536)
    p.add_argument("--images", type=int, default=8, help="images in the step")
    p.add_argument("--sizes", type=int, nargs="+", default=[448], help="image sides in pixels, cycled")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    p.add_argument("--smoke", action="store_true", help="a tiny tower and step, one iteration (checks it runs)")
    args = p.parse_args(argv)
    if args.smoke:
        args.depth, args.width, args.heads, args.out_dim = 2, 256, 4, 128
        args.images, args.sizes, args.iters = 4, [112, 56], 1
    for size in args.sizes:
        if size % (PATCH * MERGE):
            raise SystemExit(f"--sizes: {size} is not a multiple of {PATCH * MERGE} (patch x merge)")
    return args


def build_tower(args: argparse.Namespace, shard: bool = False) -> nn.Module:
    """The benchmark's tower with seeded random weights (normal std 0.02, biases 0, norms 1), cast, its blocks split
    over the tensor-parallel ranks when `shard`, and packed."""
    from benchmarks.int8_towers import random_qwen2_tower
    from vlserve.encoders.vision_layers import VisionTowerConfig
    from vlserve.kernels.packed_linear import pack_linears_for_cpu
    from vlserve.models.tower_sharding import shard_tower_blocks

    cfg = VisionTowerConfig(
        depth=args.depth,
        width=args.width,
        num_heads=args.heads,
        mlp_hidden=4 * args.width,
        hidden_act="quick_gelu",
        out_dim=args.out_dim,
    )
    tower = random_qwen2_tower(cfg).to(getattr(torch, args.dtype)).eval()
    if shard:
        shard_tower_blocks([tower])
    pack_linears_for_cpu(tower, many_rows=[tower])
    return tower


def step_images(args: argparse.Namespace) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
    """The step's images: (pixel rows `[P, 3*tp*p*p]`, grid) each, sides cycled through `--sizes`."""
    gen = torch.Generator().manual_seed(1)
    dtype = getattr(torch, args.dtype)
    images = []
    for i in range(args.images):
        side = args.sizes[i % len(args.sizes)] // PATCH
        rows = torch.randn(side * side, 3 * TEMPORAL * PATCH * PATCH, generator=gen).to(dtype)
        images.append((rows, (1, side, side)))
    return images


def time_steps(step, iters: int, barrier=None) -> list[float]:
    """Seconds of `iters` calls of `step` after one warm-up call (between barriers when given)."""
    step()
    times = []
    for _ in range(iters):
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        step()
        if barrier is not None:
            barrier()
        times.append(time.perf_counter() - t0)
    return times


def run_rank(args: argparse.Namespace, mode: str) -> list[float]:
    """This process's step times: `mode` "whole" (every image in one call of the whole tower), "weights" (the same
    call of the tower split over the group) or "data" (the images split over the group)."""
    import torch.distributed as dist

    from vlserve.worker.encoder_split import encode_across_ranks

    tower = build_tower(args, shard=mode == "weights")
    images = step_images(args)
    lengths = [t * h * w // MERGE**2 for _, (t, h, w) in images]

    def encode(indices: list[int]) -> torch.Tensor:  # [sum of their lengths, O]
        return tower(torch.cat([images[i][0] for i in indices]), [images[i][1] for i in indices])

    def step() -> None:
        with torch.inference_mode():
            if mode == "data":
                encode_across_ranks(encode, lengths, torch.device("cpu"))
            else:
                encode(list(range(len(images))))

    barrier = dist.barrier if dist.is_initialized() else None
    return time_steps(step, args.iters, barrier)


def _rank_entry(rank: int, world: int, port: int, out_dir: str, args: argparse.Namespace, mode: str) -> None:
    from vlserve.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(args.threads)
    init_tensor_parallel(rank, world, f"tcp://127.0.0.1:{port}", "gloo")
    try:
        torch.save(run_rank(args, mode), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy_tensor_parallel()


def run_group(args: argparse.Namespace, world: int, mode: str) -> list[float]:
    """Step seconds of a group of `world` spawned ranks (the slowest rank's, per iteration)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="vlserve-enctp-") as out_dir:
        mp.spawn(_rank_entry, args=(world, port, out_dir, args, mode), nprocs=world, join=True)
        per_rank = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
    return [max(times) for times in zip(*per_rank)]


def main(argv=None) -> None:
    args = parse_args(argv)
    patches = sum(t * h * w for _, (t, h, w) in step_images(args))
    print(
        f"tower depth {args.depth} width {args.width} heads {args.heads} {args.dtype}; step: {args.images} images "
        f"of {args.sizes} px ({patches} patch rows); {args.threads} thread(s) per process, {args.iters} iterations"
    )
    runs = {
        "TP 1": run_group(args, 1, "whole"),
        "TP 2 weights": run_group(args, 2, "weights"),
        "TP 2 data": run_group(args, 2, "data"),
    }
    base = statistics.median(runs["TP 1"])
    for label, times in runs.items():
        step = statistics.median(times)
        print(f"{label:<14} step {step:8.3f} s | {args.images / step:8.2f} images/s | {base / step:5.2f}x vs TP 1")


if __name__ == "__main__":
    main()
