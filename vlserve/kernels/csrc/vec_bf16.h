// float32 <-> bf16 vectors for the elementwise CPU kernels (silu_mul, quick_gelu, rms_norm, segment attention).
// Rounding to bf16 is to nearest even, as torch rounds. Where the source is built with AVX512-BF16 one instruction
// does it, and that instruction rounds float32 denormals (below 1.2e-38 in magnitude) to a signed zero where torch
// keeps a bf16 denormal; elsewhere ATen's integer sequence rounds exactly as torch. A NaN stays a NaN. Widening a
// bf16 is exact either way. (Checking each vector for denormals, to round those the slow way, would cost about a
// third of the gain.)
#ifndef VLSERVE_VEC_BF16_H  // (pasted into one source by cpp_build.kernel_source: a guard, not pragma once)
#define VLSERVE_VEC_BF16_H
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

namespace vec_bf16 {

using Vec = at::vec::Vectorized<float>;
using BVec = at::vec::Vectorized<c10::BFloat16>;  // two float vectors' worth of lanes

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define VLSERVE_NATIVE_BF16 1
#endif

// (lo, hi) rounded to bf16, lo's lanes first
inline BVec to_bf16(const Vec& lo, const Vec& hi) {
#ifdef VLSERVE_NATIVE_BF16
    return BVec((__m512i)_mm512_cvtne2ps_pbh(hi, lo));
#else
    return at::vec::convert_from_float<c10::BFloat16>(lo, hi);
#endif
}

// v rounded to bf16 and widened back: the float32 value a torch bf16 op stores
inline Vec round_bf16(const Vec& v) {
#ifdef VLSERVE_NATIVE_BF16
    const __m256i bits = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#else
    return at::vec::convert<float>(at::vec::convert<c10::BFloat16>(v));
#endif
}

// the Vec::size() lanes of v rounded to bf16, stored at p
inline void store_bf16(c10::BFloat16* p, const Vec& v) {
#ifdef VLSERVE_NATIVE_BF16
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
    at::vec::convert<c10::BFloat16>(v).store(p, Vec::size());
#endif
}

}  // namespace vec_bf16

#endif  // VLSERVE_VEC_BF16_H
