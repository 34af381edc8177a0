"""Linear micro-benchmark on CPU: the packed C++ kernel (`kernels.cpu_linear`, what the runner's projections call on
CPUs with AVX-512 or AVX2 + FMA; the header names the path that ran, $VLSERVE_CPU_ISA=avx2 forces the AVX2 one)
against oneDNN on the same operands, as eager `F.linear` and as the prepacked `mkldnn._linear_pointwise` that
inductor's frozen graphs call.

Default mode: one decoder layer's four projections (qkv, o, gate_up, down) of a Qwen2 with the given hidden size
(GQA 4:1, MLP 3x hidden), summed. "hot" times back-to-back calls (weights in cache); "cold" times a call after a
64 MB buffer was written (weights and TLB evicted, as in a decode step whose weights do not fit the caches). The
engines alternate call by call, so the machine's drift hits all of them alike; medians in microseconds.

`--gflops`: GFLOP/s of the kernel and of F.linear per shape (hot, medians, alternating call by call), for the
decode rows of that layer's projections (`--decode-rows`, default 1 8 32) and for vision-tower shapes
(`--tower-rows`, default 1024 4096, times (N, K) of a 512-wide tower's qkv, o, MLP up and down and a 1280-wide
one's qkv, MLP up and down).

    python -m benchmarks.cpu_linear [--dtype bfloat16 float32] [--hidden-size 512] [--rows 1 8 32 256 2048]
    python -m benchmarks.cpu_linear --gflops [--dtype bfloat16 float32] [--decode-rows 1 8 32]
        [--tower-rows 1024 4096]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from vlserve.kernels.cpu_linear import cpu_linear, cpu_linear_isa, cpu_linear_supported, pack_linear_weight

TOWER_SHAPES = [(1536, 512), (512, 512), (2048, 512), (512, 2048), (3840, 1280), (5120, 1280), (1280, 5120)]


def layer_shapes(hidden: int) -> list[tuple[int, int]]:
    """(N, K) of qkv, o, gate_up and down for `hidden` with head dim 64, 4 query heads per KV head, MLP 3x."""
    kv = max(hidden // 64 // 4, 1) * 64
    return [(hidden + 2 * kv, hidden), (hidden, hidden), (6 * hidden, hidden), (hidden, 3 * hidden)]


def layer(dtype: torch.dtype, hidden_size: int, rows: list[int], iters: int) -> None:
    """Per row count: one layer's four projections, kernel vs F.linear vs prepacked oneDNN, hot and cold."""
    g = torch.Generator().manual_seed(0)
    flush = torch.zeros(16 * 1024 * 1024)  # 64 MB
    shapes = layer_shapes(hidden_size)
    print(f"one layer of hidden {hidden_size}: (N, K) = {shapes}")
    print(
        f"{'rows':>5} | {'kernel hot':>10} {'cold':>7} | {'F.linear hot':>12} {'cold':>7} | "
        f"{'prepacked hot':>13} {'cold':>7} | cold: F.linear/kernel  prepacked/kernel  kernel GFLOP/s"
    )
    for m in rows:
        ops = []
        for n, k in shapes:
            x = torch.randn(m, k, generator=g).to(dtype)
            w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
            packed, onednn = pack_linear_weight(w), torch.ops.mkldnn._reorder_linear_weight(w, m)
            ops.append(
                {
                    "kernel": (lambda x=x, p=packed, n=n: cpu_linear(x, p, None, n)),
                    "F.linear": (lambda x=x, w=w: F.linear(x, w)),
                    "prepacked": (lambda x=x, p=onednn: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")),
                }
            )
        times = {name: ([], []) for name in ops[0]}
        for _ in range(max(5, iters if m <= 256 else iters // 6)):
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
        print(
            f"{m:>5} | {kh:>10.0f} {kc:>7.0f} | {med['F.linear'][0]:>12.0f} {med['F.linear'][1]:>7.0f} | "
            f"{med['prepacked'][0]:>13.0f} {med['prepacked'][1]:>7.0f} | "
            f"{med['F.linear'][1] / kc:>5.2f}x {med['prepacked'][1] / kc:>16.2f}x {flop / kh / 1e3:>15.0f} (hot)"
        )


def gflops(dtype: torch.dtype, cases: list[tuple[str, int, int, int]], iters: int) -> None:
    """One line per (label, M, N, K): median GFLOP/s of the kernel and of F.linear, hot, alternating call by call."""
    g = torch.Generator().manual_seed(0)
    print(
        f"{'shape':>8} {'M':>5} {'N':>5} {'K':>5} | {'kernel GFLOP/s':>14} {'F.linear GFLOP/s':>16} | kernel/F.linear"
    )
    for label, m, n, k in cases:
        x = torch.randn(m, k, generator=g).to(dtype)
        w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
        packed = pack_linear_weight(w)
        ops = {"kernel": lambda: cpu_linear(x, packed, None, n), "F.linear": lambda: F.linear(x, w)}
        flop = 2 * m * n * k
        samples = {name: [] for name in ops}
        for op in ops.values():  # warm-up: first-touch of the output, the kernel's scratch, oneDNN's primitives
            op()
        for _ in range(max(5, min(iters, int(4e10 // flop)))):
            for name, op in ops.items():
                t0 = time.perf_counter()
                op()
                samples[name].append(time.perf_counter() - t0)
        rate = {name: flop / sorted(s)[len(s) // 2] / 1e9 for name, s in samples.items()}
        print(
            f"{label:>8} {m:>5} {n:>5} {k:>5} | {rate['kernel']:>14.1f} {rate['F.linear']:>16.1f} | "
            f"{rate['kernel'] / rate['F.linear']:>6.2f}x",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256, 2048])
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument(
        "--dtype", nargs="+", choices=["bfloat16", "float32"], help="default: bfloat16; with --gflops, both"
    )
    parser.add_argument("--gflops", action="store_true", help="GFLOP/s per shape, decode and vision-tower shapes")
    parser.add_argument("--decode-rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tower-rows", type=int, nargs="+", default=[1024, 4096])
    args = parser.parse_args()
    for name in args.dtype or (["bfloat16", "float32"] if args.gflops else ["bfloat16"]):
        dtype = getattr(torch, name)
        if not cpu_linear_supported(torch.zeros(32, 32, dtype=dtype)):
            sys.exit(f"this CPU or toolchain cannot run the {name} kernel: nothing to compare")
        print(f"{name}: the kernel's {cpu_linear_isa(dtype)} path, {torch.get_num_threads()} threads")
        if args.gflops:
            decode = [("decode", m, n, k) for m in args.decode_rows for n, k in layer_shapes(args.hidden_size)]
            tower = [("tower", m, n, k) for m in args.tower_rows for n, k in TOWER_SHAPES]
            gflops(dtype, decode + tower, args.iters)
        else:
            layer(dtype, args.hidden_size, args.rows, args.iters)


if __name__ == "__main__":
    main()
