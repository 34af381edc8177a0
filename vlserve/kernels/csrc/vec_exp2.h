// 2^t on AVX-512 for softmax weights, where t <= 0 up to rounding (scores less their row's max, in log2 units).
#ifndef VLSERVE_VEC_EXP2_H  // (pasted into one source by cpp_build.kernel_source: a guard, not pragma once)
#define VLSERVE_VEC_EXP2_H
#include <immintrin.h>

#if defined(CPU_CAPABILITY_AVX512)
namespace vec_exp2 {

// 2^floor(t) times the polynomial c (highest power first) of t's fraction, for t below about 1 (-inf included:
// exactly 0, as for every t <= -200)
template <int N>
inline __m512 exp2_by_polynomial(__m512 t, const float (&c)[N]) {
    t = _mm512_max_ps(t, _mm512_set1_ps(-200.0f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);  // [0, 1)
    __m512 p = _mm512_set1_ps(c[0]);
    for (int k = 1; k < N; ++k) p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(c[k]));
    return _mm512_scalef_ps(p, n);
}

// degree 4, relative error under 3e-6: bf16 weights, whose rounding is far coarser
inline __m512 exp2_nonpositive(__m512 t) {
    static constexpr float c[] = {0.013533933f, 0.052011240f, 0.24144343f, 0.69300354f, 1.0000026f};
    return exp2_by_polynomial(t, c);
}

// degree 6, relative error about 1e-7 (float32's own rounding): float32 softmax weights
inline __m512 exp2_nonpositive_f32(__m512 t) {
    static constexpr float c[] = {0.00021690609f, 0.0012443082f, 0.0096784728f, 0.055483524f,
                                  0.24022980f,    0.69314700f,   1.0f};
    return exp2_by_polynomial(t, c);
}

}  // namespace vec_exp2
#endif  // CPU_CAPABILITY_AVX512
#endif  // VLSERVE_VEC_EXP2_H
