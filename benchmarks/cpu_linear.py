"""Linear micro-benchmark on CPU: the packed C++ kernel (`kernels.cpu_linear`, what the runner's projections call on
CPUs with AVX-512; bf16 needs AVX512-BF16) against oneDNN on the same operands, as eager `F.linear` and as the
prepacked `mkldnn._linear_pointwise` that inductor's frozen graphs call.

Shapes are one decoder layer's four projections (qkv, o, gate_up, down) of a Qwen2 with the given hidden size
(GQA 4:1, MLP 3x hidden), summed. "hot" times back-to-back calls (weights in cache); "cold" times a call after a
64 MB buffer was written (weights and TLB evicted, as in a decode step whose weights do not fit the caches). The
engines alternate call by call, so the machine's drift hits all of them alike; medians in microseconds.

    python benchmarks/cpu_linear.py [--dtype bfloat16|float32] [--hidden-size 512] [--rows 1 8 32 256 2048]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlserve.kernels.cpu_linear import cpu_linear, cpu_linear_supported, pack_linear_weight  # noqa: E402


def layer_shapes(hidden: int) -> list[tuple[int, int]]:
    """(N, K) of qkv, o, gate_up and down for `hidden` with head dim 64, 4 query heads per KV head, MLP 3x."""
    kv = max(hidden // 64 // 4, 1) * 64
    return [(hidden + 2 * kv, hidden), (hidden, hidden), (6 * hidden, hidden), (hidden, 3 * hidden)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256, 2048])
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if not cpu_linear_supported(torch.zeros(32, 32, dtype=dtype)):
        sys.exit(f"this CPU or toolchain cannot run the {args.dtype} kernel: nothing to compare")
    g = torch.Generator().manual_seed(0)
    flush = torch.zeros(16 * 1024 * 1024)  # 64 MB
    shapes = layer_shapes(args.hidden_size)
    print(f"{args.dtype}, {torch.get_num_threads()} threads, one layer of hidden {args.hidden_size}: (N, K) = {shapes}")
    print(f"{'rows':>5} | {'kernel hot':>10} {'cold':>7} | {'F.linear hot':>12} {'cold':>7} | "
          f"{'prepacked hot':>13} {'cold':>7} | cold: F.linear/kernel  prepacked/kernel  kernel GFLOP/s")
    for m in args.rows:
        ops = []
        for n, k in shapes:
            x = torch.randn(m, k, generator=g).to(dtype)
            w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
            packed, onednn = pack_linear_weight(w), torch.ops.mkldnn._reorder_linear_weight(w, m)
            ops.append({"kernel": (lambda x=x, p=packed, n=n: cpu_linear(x, p, None, n)),
                        "F.linear": (lambda x=x, w=w: F.linear(x, w)),
                        "prepacked": (lambda x=x, p=onednn: torch.ops.mkldnn._linear_pointwise(x, p, None, "none",
                                                                                                [], ""))})
        times = {name: ([], []) for name in ops[0]}
        iters = max(5, args.iters if m <= 256 else args.iters // 6)
        for _ in range(iters):
            for name, (hot, cold) in times.items():
                for which, samples in (("cold", cold), ("hot", hot)):
                    total = 0.0
                    for op in ops:
                        if which == "cold":
                            flush.add_(1.0)
                        t0 = time.perf_counter()
                        op[name]()
                        total += time.perf_counter() - t0
                    samples.append(total)
        med = {name: tuple(sorted(s)[len(s) // 2] * 1e6 for s in pair) for name, pair in times.items()}
        flop = sum(2 * m * n * k for n, k in shapes)
        kh, kc = med["kernel"]
        print(f"{m:>5} | {kh:>10.0f} {kc:>7.0f} | {med['F.linear'][0]:>12.0f} {med['F.linear'][1]:>7.0f} | "
              f"{med['prepacked'][0]:>13.0f} {med['prepacked'][1]:>7.0f} | "
              f"{med['F.linear'][1] / kc:>5.2f}x {med['prepacked'][1] / kc:>16.2f}x {flop / kh / 1e3:>15.0f} (hot)")


if __name__ == "__main__":
    main()
