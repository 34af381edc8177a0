// 2^t on AVX-512 for softmax weights, where t <= 0 up to rounding (scores less their row's max, in log2 units).
#ifndef VLSERVE_VEC_EXP2_H  // (pasted into one source by cpp_build.kernel_source: a guard, not pragma once)
#define VLSERVE_VEC_EXP2_H
#include <immintrin.h>

#if defined(CPU_CAPABILITY_AVX512)
namespace vec_exp2 {

// 2^t for t below about 1 (-inf included: exactly 0, as for every t <= -200): 2^floor(t) times a degree-4
// polynomial in the fraction (relative error under 3e-6)
inline __m512 exp2_nonpositive(__m512 t) {
    t = _mm512_max_ps(t, _mm512_set1_ps(-200.0f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);  // [0, 1)
    __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(0.013533933f), _mm512_set1_ps(0.052011240f));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.24144343f));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.69300354f));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.0000026f));
    return _mm512_scalef_ps(p, n);
}

// The same to float32's precision (a degree-6 polynomial, relative error about 1e-7): float32 softmax weights
inline __m512 exp2_nonpositive_f32(__m512 t) {
    t = _mm512_max_ps(t, _mm512_set1_ps(-200.0f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);  // [0, 1)
    __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(0.00021690609f), _mm512_set1_ps(0.0012443082f));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.0096784728f));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.055483524f));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.24022980f));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.69314700f));
    p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

}  // namespace vec_exp2
#endif  // CPU_CAPABILITY_AVX512
#endif  // VLSERVE_VEC_EXP2_H
