"""This CPU's arithmetic peak: GFLOP/s of a register-only loop of independent FMAs (float32) and of `vdpbf16ps`
(bf16 pairs into float32, where the CPU has AVX512-BF16), on every core at once. No GEMM can beat it, so a workload's
FLOPs over it is a floor on its time (`benchmarks.pooling_gemm_share` uses it that way).

    python -m benchmarks.cpu_peak [--threads N]

Each thread runs 12 independent accumulators (more than an FMA's latency times its issue rate on current cores)
for a fixed count; the time is the wall time of all threads. AMX tiles are not measured.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <cstdint>

// mode 0: float32 FMAs (zmm on AVX-512, else ymm); mode 1: vdpbf16ps on zmm. Writes one sum per thread to `sink`.
extern "C" void kernel(int64_t mode, int64_t iters, int64_t threads, float* sink) {
#pragma omp parallel num_threads(threads)
    {
        float total = 0.f;
#if defined(__AVX512F__)
        __m512 acc[12];
        for (int j = 0; j < 12; ++j) acc[j] = _mm512_setzero_ps();
        if (mode == 0) {
            __m512 a = _mm512_set1_ps(1e-9f), b = _mm512_set1_ps(1.f);
            for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
                for (int j = 0; j < 12; ++j) acc[j] = _mm512_fmadd_ps(a, b, acc[j]);
                __asm__ volatile("" : "+v"(a));
            }
        }
#if defined(__AVX512BF16__)
        if (mode == 1) {
            __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3f803f80);
            for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
                for (int j = 0; j < 12; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
                __asm__ volatile("" : "+v"(a));
            }
        }
#endif
        for (int j = 0; j < 12; ++j) total += _mm512_reduce_add_ps(acc[j]);
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 acc[12];
        for (int j = 0; j < 12; ++j) acc[j] = _mm256_setzero_ps();
        __m256 a = _mm256_set1_ps(1e-9f), b = _mm256_set1_ps(1.f);
        for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
            for (int j = 0; j < 12; ++j) acc[j] = _mm256_fmadd_ps(a, b, acc[j]);
            __asm__ volatile("" : "+v"(a));
        }
        float lanes[8];
        for (int j = 0; j < 12; ++j) {
            _mm256_storeu_ps(lanes, acc[j]);
            for (int l = 0; l < 8; ++l) total += lanes[l];
        }
#endif
        sink[omp_get_thread_num()] = total;
    }
}
"""


@functools.cache
def _kernel():
    import torch
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    prefix = '#pragma GCC target("avx512bf16")\n' if torch.cpu._is_avx512_bf16_supported() else ""
    declaration = (
        '#include <cstdint>\nextern "C" void kernel(int64_t mode, int64_t iters, int64_t threads, float* sink);'
    )
    return CppPythonBindingsCodeCache.load_pybinding(
        ["int64_t", "int64_t", "int64_t", "float*"],
        declaration,
        kernel_code=prefix + _SOURCE,
        kernel_needs_vec_isa=True,
    )


def _lanes() -> int:
    """float32 lanes of one FMA in the built kernel (16 on AVX-512, 8 on AVX2)."""
    import torch

    return 16 if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16") else 8


def peak_gflops(dtype: str, threads: int | None = None, iters: int = 20_000_000) -> float | None:
    """Best of three runs, GFLOP/s on `threads` cores (default: all): "float32" FMAs, or "bfloat16" pairs
    through vdpbf16ps (None where the CPU has no AVX512-BF16)."""
    import torch

    threads = threads or os.cpu_count() or 1
    if dtype == "bfloat16" and not torch.cpu._is_avx512_bf16_supported():
        return None
    mode = 1 if dtype == "bfloat16" else 0
    # per iteration and thread: 12 instructions of `lanes` float32 lanes, 2 FLOPs each (bf16: 2 pairs, 4 FLOPs)
    flops = iters * threads * 12 * _lanes() * (4 if mode == 1 else 2)
    sink = torch.zeros(threads)
    kernel = _kernel()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        kernel(mode, iters, threads, sink)
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None, help="cores to run on (default: all)")
    args = p.parse_args()
    for dtype in ("float32", "bfloat16"):
        rate = peak_gflops(dtype, args.threads)
        print(f"{dtype}: " + ("no AVX512-BF16 here" if rate is None else f"{rate:.1f} GFLOP/s"))


if __name__ == "__main__":
    main()
