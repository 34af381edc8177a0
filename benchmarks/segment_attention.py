"""Segment attention on CPU: the C++ kernel (`segment_attention_cpu`, whichever path it takes here: bf16 pairs or
the widened float32 path) against torch SDPA on the same segments laid out as [B, H, L, D], in ms and GFLOP/s.

    python -m benchmarks.segment_attention [--dtype bfloat16 float32] [--head-dim 64 80] [--iters 5]

Cases: B segments of L rows, both ways (8 query and 8 KV heads) and causal (8 query heads over 2 KV heads). SDPA
gets its inputs contiguous per head, so its time leaves out the gather `varlen_attention` pays to call it. The
kernel runs every case here, past `max_segment_len` too: the table is what those limits are read from.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from vlserve.kernels.varlen_attention_cpu import (
    bf16_pair_engine,
    max_segment_len,
    segment_attention_cpu,
    varlen_attention_cpu_kernel,
)

CASES = [(32, 16), (16, 64), (5, 256), (5, 768), (1, 2048)]  # (segments, rows each)


def _best_ms(fn, iters: int) -> float:
    fn()
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--head-dim", nargs="+", type=int, default=[64, 80])
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    if varlen_attention_cpu_kernel() is None:
        raise SystemExit("the segment attention kernel does not build here")
    print(f"bf16 pair engine here: {bf16_pair_engine()}; {torch.get_num_threads()} threads")
    print("dtype     D  causal    B     L |  kernel ms  GFLOP/s |  SDPA ms  GFLOP/s | SDPA/kernel | limit")
    torch.manual_seed(0)
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for head_dim in args.head_dim:
            for causal in (False, True):
                hq, hkv = (8, 2) if causal else (8, 8)
                limit = max_segment_len(causal, dtype, head_dim)
                for b, length in CASES:
                    q = torch.randn(b * length, hq, head_dim).to(dtype)  # [T, Hq, D]
                    k, v = (torch.randn(b * length, hkv, head_dim).to(dtype) for _ in range(2))  # [T, Hkv, D]
                    out = torch.empty_like(q)
                    starts = [i * length for i in range(b)]
                    scale = head_dim**-0.5
                    qh, kh, vh = (t.view(b, length, -1, head_dim).transpose(1, 2).contiguous() for t in (q, k, v))

                    def kernel() -> None:
                        segment_attention_cpu(q, k, v, starts, [length] * b, scale, causal, out)

                    def sdpa() -> torch.Tensor:
                        return F.scaled_dot_product_attention(
                            qh, kh, vh, is_causal=causal, scale=scale, enable_gqa=True
                        )  # [B, Hq, L, D]

                    with torch.no_grad():
                        t_kernel, t_sdpa = _best_ms(kernel, args.iters), _best_ms(sdpa, args.iters)
                    gflop = 4 * b * hq * length * length * head_dim / 1e9 / (2 if causal else 1)
                    print(
                        f"{dtype_name:8} {head_dim:3} {causal!s:>7} {b:4} {length:5} | {t_kernel:10.2f} "
                        f"{gflop / t_kernel * 1e3:8.0f} | {t_sdpa:8.2f} {gflop / t_sdpa * 1e3:8.0f} | "
                        f"{t_sdpa / t_kernel:10.2f}x | {limit}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
