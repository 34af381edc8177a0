// Linear layers on packed weights (see vlserve/kernels/cpu_linear.py), for a gated MLP's gate_up projection
// SiLU(gate) * up in the same pass, and SiLU of a projection's outputs in its epilogue. Two code paths over the same
// packed layouts:
// - cpu_linear_avx512.cpp, where the source is built for AVX-512 (CPU_CAPABILITY_AVX512): float32 through FMAs on
//   zmm registers, bf16 through vdpbf16ps where the CPU has AVX512-BF16;
// - cpu_linear_avx2.cpp, built always (AVX2 + FMA, which every AVX-512 CPU has too): float32 FMAs on ymm registers,
//   bf16 weights and inputs widened to float32 in registers. It serves both dtypes where the source is built for
//   AVX2, bf16 on AVX-512 CPUs without AVX512-BF16, and everything where VLSERVE_FORCE_AVX2 is defined (cpu_linear.py
//   prepends that for VLSERVE_CPU_ISA=avx2).
// cpu_linear.py pastes the quoted includes below into one source: inductor compiles a single string.
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "cpu_linear is built for AVX2 + FMA or AVX-512 only"
#endif

#include "cpu_linear_common.h"

#include "cpu_linear_avx2.cpp"
#if defined(CPU_CAPABILITY_AVX512) && !defined(VLSERVE_FORCE_AVX2)
#include "cpu_linear_avx512.cpp"
#define VLSERVE_AVX512 1
#endif
#if defined(VLSERVE_AVX512) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "cpu_linear_amx.cpp"
#define VLSERVE_AMX 1
#endif

using LinearFn = void (*)(const void* a, int64_t lda, const void* packed, const void* bias, void* c, int64_t ldc,
                         int64_t M, int64_t N, int64_t K, int64_t threads, const float* add, int64_t ldadd);

// The path that serves a dtype here: its vector width, and its linear without SiLU(gate) * up, with it, with it
// after a float32 [M, 2N] addend (pre_act_add) joins the gate and up sums, and with SiLU of every output
struct Path {
    int64_t width;
    LinearFn plain, silu_mul, silu_mul_add, silu;
};

static Path path(bool is_bf16) {
#if defined(VLSERVE_AVX512) && defined(__AVX512BF16__)
    using avx512::Bf16Panel;
    if (is_bf16)
        return {512, avx512::linear<Bf16Panel, false, false>, avx512::linear<Bf16Panel, true, false>,
                avx512::linear<Bf16Panel, true, true>, avx512::linear<Bf16Panel, false, false, true>};
#endif
    if (is_bf16)
        return {256, avx2::linear<avx2::Bf16, false, false>, avx2::linear<avx2::Bf16, true, false>,
                avx2::linear<avx2::Bf16, true, true>, avx2::linear<avx2::Bf16, false, false, true>};
#if defined(VLSERVE_AVX512)
    using avx512::F32Panel;
    return {512, avx512::linear<F32Panel, false, false>, avx512::linear<F32Panel, true, false>,
            avx512::linear<F32Panel, true, true>, avx512::linear<F32Panel, false, false, true>};
#else
    return {256, avx2::linear<avx2::F32, false, false>, avx2::linear<avx2::F32, true, false>,
            avx2::linear<avx2::F32, true, true>, avx2::linear<avx2::F32, false, false, true>};
#endif
}

// a: [M, K] (rows lda apart); packed: [ceil(N/32), K, 32] float32 or [ceil(N/32), K/2, 32, 2] bf16; bias: [N] or
// null; c: [M, N] (rows ldc apart). epilogue 1 (SiLU(gate) * up): packed holds [2N/32, ...] (gate panels, then up
// panels; N % 32 == 0), bias [2N] or null, and c gets SiLU(x gate^T) * (x up^T); epilogue 2: c gets SiLU(x W^T + b)
// (the sums rounded to the dtype, then the activation); 0: c = x W^T + b.
// has_add (epilogue 1 only): add [M, 2N] float32 (rows ldadd apart) joins the gate sums (columns 0..N) and the up
// sums (N..2N) after the bias, before the rounding and the activation: c = SiLU(gate + add_g) * (up + add_u).
// is_bf16 & 2 (bf16 only): on the AMX tiles where this build and process have them and K % 32 == 0
// (cpu_linear_amx.cpp), else as without it.
// M = -1 asks which path serves the dtype instead: c[0] (an int64) gets its vector width in bits, 512 or 256;
// M = -2 whether bf16 can run on the AMX tiles: c[0] = 1 or 0.
extern "C" void kernel(const void* a, int64_t lda, const void* packed, const void* bias, int64_t has_bias, void* c,
                       int64_t ldc, int64_t M, int64_t N, int64_t K, int64_t threads, int64_t is_bf16,
                       int64_t epilogue, const void* add, int64_t ldadd, int64_t has_add) {
    const Path p = path(is_bf16 & 1);
    if (M < 0) {
#if defined(VLSERVE_AMX)
        const int64_t amx = amx_tiles::permitted();
#else
        const int64_t amx = 0;
#endif
        *(int64_t*)c = M == -2 ? amx : p.width;
        return;
    }
#if defined(VLSERVE_AMX)
    if ((is_bf16 & 2) && amx::serves(K)) {
        const LinearFn f = epilogue == 2 ? amx::linear<false, false, true>
                           : epilogue == 0 ? amx::linear<false>
                           : has_add       ? amx::linear<true, true>
                                           : amx::linear<true>;
        return f(a, lda, packed, has_bias ? bias : nullptr, c, ldc, M, N, K, threads,
                 has_add ? (const float*)add : nullptr, ldadd);
    }
#endif
    const LinearFn f = epilogue == 2 ? p.silu : epilogue == 0 ? p.plain : has_add ? p.silu_mul_add : p.silu_mul;
    f(a, lda, packed, has_bias ? bias : nullptr, c, ldc, M, N, K, threads, has_add ? (const float*)add : nullptr,
      ldadd);
}
