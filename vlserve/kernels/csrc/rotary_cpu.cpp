// NeoX / HF rotary embedding (with Qwen2-VL M-RoPE sections) on CPU, in place on query and key: see
// vlserve/kernels/rotary_cpu.py. Bit-identical to rotary_ref.apply_rotary_ref: cos / sin are taken from the cache
// and rounded to the tensor's dtype, and o1 = x1 cos - x2 sin, o2 = x2 cos + x1 sin are evaluated op by op, each
// product and sum rounded to that dtype (bf16: computed in float32, rounded to nearest even, as torch's CPU bf16
// ops do). No FMA: a fused multiply-add would round once where torch rounds twice. With float32_math, bf16 tensors
// rotate as float32 copies of them would (the float32 cache, float32 ops) and round once when stored: HF's vision
// towers' `q.float()` rotation then `.to(bf16)`.
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using bf16 = uint16_t;

inline float widen(bf16 v) {
    uint32_t u = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline bf16 narrow(float f) {  // nearest even; NaN -> 0x7fc0, as torch rounds
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return bf16((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float round_to(float f, bool is_bf16) { return is_bf16 ? widen(narrow(f)) : f; }

// 8 floats rounded through bf16 (nearest even; NaN stays NaN, as torch's 0x7fc0 widens to a NaN)
inline __m256 round8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))),
                                       _mm256_set1_epi32(int32_t(0xffff0000u)));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
}

template <bool kBf16>
inline __m256 load8(const void* p, int64_t i) {
    if constexpr (kBf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const bf16*)p + i))), 16));
    else
        return _mm256_loadu_ps((const float*)p + i);
}

template <bool kBf16>
inline void store8(void* p, int64_t i, __m256 v) {  // v already a bf16 value where kBf16
    if constexpr (kBf16) {
        const __m256i u = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
        _mm_storeu_si128((__m128i*)((bf16*)p + i), packed);
    } else {
        _mm256_storeu_ps((float*)p + i, v);
    }
}

template <bool kRound>
inline __m256 rnd(__m256 v) {
    if constexpr (kRound) return round8(v);
    else return v;
}

#if defined(__AVX512F__)
// the same on 16 lanes: rounding, loads and stores as round8 / load8 / store8
inline __m512 round16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))),
                                       _mm512_set1_epi32(int32_t(0xffff0000u)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc00000)));
}

template <bool kBf16>
inline __m512 load16(const void* p, int64_t i) {
    if constexpr (kBf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const bf16*)p + i))), 16));
    else
        return _mm512_loadu_ps((const float*)p + i);
}

template <bool kBf16>
inline void store16(void* p, int64_t i, __m512 v) {  // v already a bf16 value where kBf16
    if constexpr (kBf16)
        _mm256_storeu_si256((__m256i*)((bf16*)p + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
    else
        _mm512_storeu_ps((float*)p + i, v);
}

template <bool kRound>
inline __m512 rnd16(__m512 v) {
    if constexpr (kRound) return round16(v);
    else return v;
}
#endif

// one head's first 2 * half dims rotated in place by per-frequency c / s (already rounded as kRound says):
// kRound rounds every product and sum to bf16; otherwise float32 ops, one rounding at a bf16 store
template <bool kBf16, bool kRound>
void rotate_head(void* x, int64_t half, const float* c, const float* s) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= half; j += 16) {
        const __m512 x1 = load16<kBf16>(x, j), x2 = load16<kBf16>(x, half + j);
        const __m512 cv = _mm512_loadu_ps(c + j), sv = _mm512_loadu_ps(s + j);
        const __m512 o1 =
            rnd16<kRound>(_mm512_sub_ps(rnd16<kRound>(_mm512_mul_ps(x1, cv)), rnd16<kRound>(_mm512_mul_ps(x2, sv))));
        const __m512 o2 =
            rnd16<kRound>(_mm512_add_ps(rnd16<kRound>(_mm512_mul_ps(x2, cv)), rnd16<kRound>(_mm512_mul_ps(x1, sv))));
        store16<kBf16>(x, j, rnd16<kBf16 && !kRound>(o1));
        store16<kBf16>(x, half + j, rnd16<kBf16 && !kRound>(o2));
    }
#endif
    for (; j + 8 <= half; j += 8) {
        const __m256 x1 = load8<kBf16>(x, j), x2 = load8<kBf16>(x, half + j);
        const __m256 cv = _mm256_loadu_ps(c + j), sv = _mm256_loadu_ps(s + j);
        const __m256 o1 = rnd<kRound>(_mm256_sub_ps(rnd<kRound>(_mm256_mul_ps(x1, cv)), rnd<kRound>(_mm256_mul_ps(x2, sv))));
        const __m256 o2 = rnd<kRound>(_mm256_add_ps(rnd<kRound>(_mm256_mul_ps(x2, cv)), rnd<kRound>(_mm256_mul_ps(x1, sv))));
        store8<kBf16>(x, j, rnd<kBf16 && !kRound>(o1));
        store8<kBf16>(x, half + j, rnd<kBf16 && !kRound>(o2));
    }
    for (; j < half; ++j) {
        float x1, x2;
        if constexpr (kBf16) x1 = widen(((bf16*)x)[j]), x2 = widen(((bf16*)x)[half + j]);
        else x1 = ((float*)x)[j], x2 = ((float*)x)[half + j];
        const float o1 = round_to(round_to(x1 * c[j], kRound) - round_to(x2 * s[j], kRound), kRound);
        const float o2 = round_to(round_to(x2 * c[j], kRound) + round_to(x1 * s[j], kRound), kRound);
        if constexpr (kBf16) ((bf16*)x)[half + j] = narrow(o2), ((bf16*)x)[j] = narrow(o1);
        else ((float*)x)[j] = o1, ((float*)x)[half + j] = o2;
    }
}

template <bool kBf16, bool kRound>
void rotate_all(void* q, int64_t q_tok, int64_t q_head, int64_t Hq, void* k, int64_t k_tok, int64_t k_head,
                int64_t Hk, const int64_t* pos, int64_t axes, int64_t T, const void* cos_cache,
                const void* sin_cache, int64_t cache_bf16, int64_t half, const int64_t* section, int64_t threads) {
    const int64_t esize = kBf16 ? 2 : 4;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> c(half), s(half);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            for (int64_t axis = 0, j0 = 0; j0 < half; ++axis) {  // frequencies j0 .. j1 take axis's position
                const int64_t j1 = axes == 3 && axis < 2 ? std::min(half, j0 + section[axis]) : half;
                const int64_t base = pos[(axes == 3 ? axis * T : 0) + t] * half;
                if (cache_bf16) {
                    const bf16 *cc = (const bf16*)cos_cache + base, *sc = (const bf16*)sin_cache + base;
                    for (int64_t j = j0; j < j1; ++j) c[j] = round_to(widen(cc[j]), kRound), s[j] = round_to(widen(sc[j]), kRound);
                } else {
                    const float *cc = (const float*)cos_cache + base, *sc = (const float*)sin_cache + base;
                    for (int64_t j = j0; j < j1; ++j) c[j] = round_to(cc[j], kRound), s[j] = round_to(sc[j], kRound);
                }
                j0 = j1;
            }
            for (int64_t h = 0; h < Hq; ++h)
                rotate_head<kBf16, kRound>((char*)q + (t * q_tok + h * q_head) * esize, half, c.data(), s.data());
            for (int64_t h = 0; h < Hk; ++h)
                rotate_head<kBf16, kRound>((char*)k + (t * k_tok + h * k_head) * esize, half, c.data(), s.data());
        }
    }
}

}  // namespace

// q [T, Hq, D], k [T, Hk, D] (float32 or bf16: is_bf16; strides in elements per token and per head, the last dim
// contiguous); pos int64 [T] (axes 1) or [3, T] (axes 3, M-RoPE: frequency j takes its position from the axis whose
// section holds it); cos / sin caches [P, half] float32 or bf16 (cache_bf16); the first 2 * half dims rotate;
// float32_math: bf16 tensors rotated in float32, rounded once (see the top).
extern "C" void kernel(void* q, int64_t q_tok, int64_t q_head, int64_t Hq, void* k, int64_t k_tok, int64_t k_head,
                       int64_t Hk, const int64_t* pos, int64_t axes, int64_t T, const void* cos_cache,
                       const void* sin_cache, int64_t cache_bf16, int64_t half, const int64_t* section,
                       int64_t is_bf16, int64_t float32_math, int64_t threads) {
    if (is_bf16 && float32_math)
        rotate_all<true, false>(q, q_tok, q_head, Hq, k, k_tok, k_head, Hk, pos, axes, T, cos_cache, sin_cache,
                                cache_bf16, half, section, threads);
    else if (is_bf16)
        rotate_all<true, true>(q, q_tok, q_head, Hq, k, k_tok, k_head, Hk, pos, axes, T, cos_cache, sin_cache,
                               cache_bf16, half, section, threads);
    else
        rotate_all<false, false>(q, q_tok, q_head, Hq, k, k_tok, k_head, Hk, pos, axes, T, cos_cache, sin_cache,
                                 cache_bf16, half, section, threads);
}
