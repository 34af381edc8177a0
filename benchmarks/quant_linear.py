"""Quantized linear micro-benchmark on CPU: `kernels.quant_linear`'s matmuls (the C++ kernels of
`quant_linear_cpu` where prepare_* packed the weights) against the packed bf16 and float32 `cpu_linear` and eager
`F.linear` in x's dtype, on the same [N, K] shapes.

Shapes (N x K): a 0.5B Qwen2's projections (qkv 1152x896, o 896x896, MLP up 4864x896, down 896x4864) and a 7B's
MLP up 18944x3584; rows M = 1, 8, 32 (decode) and 512 (prefill); x in float32 and bf16. Columns: milliseconds per
call (the median, or with `--stat min` the fastest call, for a machine shared with other jobs; hot: back-to-back
calls, each engine in turn, so drift hits all alike; `--cold`: a 64 MB buffer written before each call, as in a
decode step whose weights do not fit the caches), then each quantized kernel's speedup over the bf16 and over the
float32 packed kernel (bf16 ms / its ms, float32 ms / its ms; above 1 is faster). Quantized kernels: W4A16 and
W8A16 with groups of 128 (asymmetric zeros, fp16 scales), W8A8 INT8 (x quantized per row), FP8 with per-channel
weight scales and per-token x, FP8 with 128x128 blocks and per-128 x groups. A bf16 F.linear of more than 4e9
multiply-adds is left out ("-"): without AVX512-BF16 oneDNN takes seconds for it.

    python -m benchmarks.quant_linear [--rows 1 8 32 512] [--dtype float32 bfloat16] [--shapes 4864x896 ...]
        [--budget 0.3] [--cold] [--stat median|min]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from vlserve.kernels import quant_linear as QL
from vlserve.kernels.cpu_linear import cpu_linear, cpu_linear_isa, pack_linear_weight
from vlserve.kernels.quant_linear_cpu import quant_kernel, quant_kernel_info

SHAPES = ["1152x896", "896x896", "4864x896", "896x4864", "18944x3584"]
QUANT = ["w4a16", "w8a16", "int8", "fp8", "fp8blk"]
SLOW_BF16_MNK = 4e9  # bf16 F.linear past this many multiply-adds is left out: seconds a call on AVX2 CPUs


def quantized(w: torch.Tensor) -> dict:
    """The prepared quantized forms of the float32 matrix w [N, K] (round to nearest, as the test checkpoints)."""
    n, k = w.shape
    g = 128 if k % 128 == 0 else k
    out = {}
    for name, bits in (("w4a16", 4), ("w8a16", 8)):
        grouped = w.view(n, k // g, g)  # [N, G, g]
        lo, hi = grouped.amin(-1), grouped.amax(-1)
        scales = ((hi - lo) / (2**bits - 1)).clamp(min=1e-8)  # [N, G]
        zeros = torch.round(-lo / scales).clamp(0, 2**bits - 1)
        q = torch.round(grouped / scales[..., None] + zeros[..., None]).clamp(0, 2**bits - 1)
        out[name] = QL.prepare_wna16(q.view(n, k).to(torch.uint8), scales.half(), zeros.to(torch.uint8), g, bits)
    s8 = w.abs().amax(1) / 127
    out["int8"] = QL.prepare_int8(torch.round(w / s8[:, None]).to(torch.int8), s8)
    s = w.abs().amax(1) / QL.FP8_MAX
    out["fp8"] = QL.prepare_fp8((w / s[:, None]).to(torch.float8_e4m3fn), s, None, "token")
    blocks = w.abs().view(n // 128, 128, k // 128, 128).amax((1, 3)) / QL.FP8_MAX if n % 128 == k % 128 == 0 else None
    if blocks is not None:
        f8 = (w / blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
        out["fp8blk"] = QL.prepare_fp8(f8, blocks, (128, 128), "group", 128)
    return out


def linear_fn(name: str, prepared):
    fn = {"w4a16": QL.wna16_linear, "w8a16": QL.wna16_linear, "int8": QL.int8_linear}.get(name, QL.fp8_linear)
    return lambda x: fn(x, prepared, None)


def timings(ops: dict, budget: float, flush: torch.Tensor | None, stat: str) -> dict:
    """Median (or least) seconds per op, timing the ops in turn until `budget` seconds per op are spent (at least 3
    rounds); with `flush`, each call follows a write of that buffer (weights evicted from the caches)."""
    for op in ops.values():  # warm-up (and the first call's builds)
        op()
    times = {name: [] for name in ops}
    spent, rounds = 0.0, 0
    while rounds < 3 or (spent < budget * len(ops) and rounds < 200):
        for name, op in ops.items():
            if flush is not None:
                flush.add_(1.0)
            t0 = time.perf_counter()
            op()
            dt = time.perf_counter() - t0
            times[name].append(dt)
            spent += dt
        rounds += 1
    return {name: sorted(t)[len(t) // 2] if stat == "median" else min(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="NxK")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds of calls per engine and row")
    parser.add_argument("--cold", action="store_true", help="write a 64 MB buffer before each call")
    parser.add_argument(
        "--stat",
        choices=["median", "min"],
        default="median",
        help="min: the fastest call (on a machine shared with other jobs)",
    )
    args = parser.parse_args()
    flush = torch.zeros(16 * 1024 * 1024) if args.cold else None
    info = quant_kernel_info() if quant_kernel() is not None else None
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu_linear: float32 "
        f"{cpu_linear_isa(torch.float32)}, bf16 {cpu_linear_isa(torch.bfloat16)}; quant kernel: {info}"
    )
    base = ["bf16", "f32", "F.linear"]
    header = (
        f"{'N x K':>11} {'M':>4} {'x':>5} | "
        + " ".join(f"{n:>8}" for n in base + QUANT)
        + " | x faster than bf16: "
        + " ".join(f"{n:>6}" for n in QUANT)
        + " | than f32: "
        + " ".join(f"{n:>6}" for n in QUANT)
    )
    print(f"milliseconds per call ({args.stat}, {'cold: caches flushed before each call' if args.cold else 'hot'})")
    print(header)
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        n, k = map(int, shape.split("x"))
        w = torch.randn(n, k, generator=g) / k**0.5
        packed = {torch.bfloat16: pack_linear_weight(w.bfloat16()), torch.float32: pack_linear_weight(w)}
        prepared = quantized(w)
        for m in args.rows:
            for dname in args.dtype:
                dtype = getattr(torch, dname)
                x = torch.randn(m, k, generator=g).to(dtype)
                xb, xf = x.bfloat16(), x.float()
                wx = w.to(dtype)
                ops = {
                    "bf16": lambda: cpu_linear(xb, packed[torch.bfloat16], None, n),
                    "f32": lambda: cpu_linear(xf, packed[torch.float32], None, n),
                }
                if dtype is torch.float32 or m * n * k <= SLOW_BF16_MNK:
                    ops["F.linear"] = lambda: F.linear(x, wx)
                for name, prep in prepared.items():
                    ops[name] = lambda f=linear_fn(name, prep): f(x)
                ms = {name: t * 1e3 for name, t in timings(ops, args.budget, flush, args.stat).items()}
                cell = lambda name: f"{ms[name]:>8.3f}" if name in ms else f"{'-':>8}"  # noqa: E731
                ratio = lambda ref, name: f"{ms[ref] / ms[name]:>6.2f}" if name in ms else f"{'-':>6}"  # noqa: E731
                print(
                    f"{shape:>11} {m:>4} {dname[:5]:>5} | "
                    + " ".join(cell(c) for c in base + QUANT)
                    + " |                     "
                    + " ".join(ratio("bf16", c) for c in QUANT)
                    + " |           "
                    + " ".join(ratio("f32", c) for c in QUANT),
                    flush=True,
                )


if __name__ == "__main__":
    main()
