// The LoRA delta of one layer for one step, in one call (see vlserve/kernels/lora_cpu.py); built through inductor's
// C++ toolchain. For every token t with slot s in [0, L) and every output slice q with rank r = ranks[s, q] > 0:
//     out[t, off_q : off_q + n_q] += (x[t] . A[s, qR : qR + r]^T) . Bt[s, :r, off_q : off_q + n_q]
// A [L, S*R, I] holds the slices' A matrices one after another (rank padded to R), Bt [L, R, Ob] their B matrices
// transposed and side by side at the output's column offsets. Sums are float32; each out element is rounded once.
// Tokens of no slot (-1, or a slot past L) are not touched.
//
// Two phases over the same OpenMP team: the shrink y[t, qR + j] = x[t] . A[s, qR + j] (units: a slot's tokens in
// chunks x its active A rows in blocks), a barrier, then the expand (units: 64-column blocks of a slice, every
// token). A unit's arithmetic never depends on the thread count, so results are the same with 1 or N threads.
#include "cpu_linear_common.h"
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LORA_AVX2 1
#endif

#define LORA_UNROLL _Pragma("GCC unroll 16")

namespace lora {

using ::bf16;  // cpu_linear_common.h's
constexpr int64_t kTokenChunk = 16;     // tokens of one shrink unit
constexpr int64_t kRowBlock = 16;       // A rows of one shrink unit
constexpr int64_t kColBlock = 64;       // output columns of one expand unit
constexpr int64_t kMinPerThread = 1 << 15;  // multiply-adds below which another thread costs more than it saves

static inline void put(float* p, float v) { *p = v; }
static inline void put(bf16* p, float v) {  // round to nearest even; NaN -> 0x7fc0, as torch rounds
    uint32_t u;
    std::memcpy(&u, &v, sizeof(u));
    *p = std::isnan(v) ? bf16(0x7fc0) : bf16((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// ---- 8 float32 lanes: ymm registers on AVX2, plain arrays otherwise -------------------------------------------------
#if defined(LORA_AVX2)
using V8 = __m256;
static inline V8 vzero() { return _mm256_setzero_ps(); }
static inline V8 vset1(float f) { return _mm256_set1_ps(f); }
static inline V8 vload(const float* p) { return _mm256_loadu_ps(p); }
static inline V8 vload(const bf16* p) {  // widen: exact, bf16 is the top half of a float32
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline V8 vfma(V8 a, V8 b, V8 c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(V8 v) {  // a fixed order: (0+4, 1+5, 2+6, 3+7), then pairs
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
static inline void vadd_store(float* p, V8 v) { _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), v)); }
static inline void vadd_store(bf16* p, V8 v) {  // p = bf16(float(p) + v), nearest even, NaN -> 0x7fc0
    const __m256 s = _mm256_add_ps(vload(p), v);
    const __m256i u = _mm256_castps_si256(s);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(s, s, _CMP_UNORD_Q)));
    _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
static inline float sfma(float a, float b, float c) { return std::fma(a, b, c); }  // what a vfma lane computes
#else
struct V8 {
    float f[8];
};
static inline V8 vzero() { return V8{}; }
static inline V8 vset1(float v) {
    V8 r;
    for (int i = 0; i < 8; ++i) r.f[i] = v;
    return r;
}
template <typename T>
static inline V8 vload(const T* p) {
    V8 r;
    for (int i = 0; i < 8; ++i) r.f[i] = to_float(p[i]);
    return r;
}
static inline V8 vfma(V8 a, V8 b, V8 c) {
    for (int i = 0; i < 8; ++i) c.f[i] += a.f[i] * b.f[i];
    return c;
}
static inline float vsum(V8 v) {
    const float h[4] = {v.f[0] + v.f[4], v.f[1] + v.f[5], v.f[2] + v.f[6], v.f[3] + v.f[7]};
    const float a = h[0] + h[2], b = h[1] + h[3];
    return a + b;
}
template <typename T>
static inline void vadd_store(T* p, V8 v) {
    for (int i = 0; i < 8; ++i) put(p + i, to_float(p[i]) + v.f[i]);
}
static inline float sfma(float a, float b, float c) { return c + a * b; }
#endif

// ---- shrink -------------------------------------------------------------------------------------------------------
// y[t][j] = x_t . a_j over I for NT tokens x NJ A rows: 8-lane sums down I, reduced in a fixed order, then the tail
template <typename T, int NT, int NJ>
static inline void dots(const T* const* x, const T* const* a, int64_t I, float* const* y, const int32_t* cols) {
    V8 acc[NT][NJ];
    LORA_UNROLL for (int t = 0; t < NT; ++t) LORA_UNROLL for (int j = 0; j < NJ; ++j) acc[t][j] = vzero();
    int64_t k = 0;
    for (; k + 8 <= I; k += 8) {
        V8 av[NJ];
        LORA_UNROLL for (int j = 0; j < NJ; ++j) av[j] = vload(a[j] + k);
        LORA_UNROLL for (int t = 0; t < NT; ++t) {
            const V8 xv = vload(x[t] + k);
            LORA_UNROLL for (int j = 0; j < NJ; ++j) acc[t][j] = vfma(xv, av[j], acc[t][j]);
        }
    }
    for (int t = 0; t < NT; ++t)
        for (int j = 0; j < NJ; ++j) {
            float s = vsum(acc[t][j]);
            for (int64_t kk = k; kk < I; ++kk) s = sfma(to_float(x[t][kk]), to_float(a[j][kk]), s);
            y[t][cols[j]] = s;
        }
}

template <typename T, int NT>
static inline void dots_rows(const T* const* x, const T* slot_a, int64_t I, float* const* y, const int32_t* rows,
                             int64_t nrows) {
    int64_t j = 0;
    for (; j + 2 <= nrows; j += 2) {
        const T* a[2] = {slot_a + rows[j] * I, slot_a + rows[j + 1] * I};
        dots<T, NT, 2>(x, a, I, y, rows + j);
    }
    if (j < nrows) {
        const T* a[1] = {slot_a + rows[j] * I};
        dots<T, NT, 1>(x, a, I, y, rows + j);
    }
}

// ---- expand -------------------------------------------------------------------------------------------------------
// out_t[0 : 8 NV] += sum_q y_t[q] * b[q, 0 : 8 NV] for NT tokens (b rows ldb apart), q in [0, r)
template <typename T, typename TO, int NT, int NV>
static inline void expand(const float* const* y, int64_t r, const T* b, int64_t ldb, TO* const* out) {
    V8 acc[NT][NV];
    LORA_UNROLL for (int t = 0; t < NT; ++t) LORA_UNROLL for (int v = 0; v < NV; ++v) acc[t][v] = vzero();
    for (int64_t q = 0; q < r; ++q) {
        V8 bv[NV];
        LORA_UNROLL for (int v = 0; v < NV; ++v) bv[v] = vload(b + q * ldb + 8 * v);
        LORA_UNROLL for (int t = 0; t < NT; ++t) {
            const V8 yv = vset1(y[t][q]);
            LORA_UNROLL for (int v = 0; v < NV; ++v) acc[t][v] = vfma(yv, bv[v], acc[t][v]);
        }
    }
    LORA_UNROLL for (int t = 0; t < NT; ++t)
        LORA_UNROLL for (int v = 0; v < NV; ++v) vadd_store(out[t] + 8 * v, acc[t][v]);
}

// columns [0, n) of NT tokens: 32 at a time, then 8 at a time, then one at a time (the same sums a lane makes)
template <typename T, typename TO, int NT>
static inline void expand_cols(const float* const* y, int64_t r, const T* b, int64_t ldb, TO* const* out, int64_t n) {
    int64_t c = 0;
    for (; c + 32 <= n; c += 32) {
        TO* o[NT];
        for (int t = 0; t < NT; ++t) o[t] = out[t] + c;
        expand<T, TO, NT, 4>(y, r, b + c, ldb, o);
    }
    for (; c + 8 <= n; c += 8) {
        TO* o[NT];
        for (int t = 0; t < NT; ++t) o[t] = out[t] + c;
        expand<T, TO, NT, 1>(y, r, b + c, ldb, o);
    }
    for (; c < n; ++c)
        for (int t = 0; t < NT; ++t) {
            float s = 0.f;
            for (int64_t q = 0; q < r; ++q) s = sfma(y[t][q], to_float(b[q * ldb + c]), s);
            put(out[t] + c, to_float(out[t][c]) + s);
        }
}

struct Group {
    int64_t slot, first, count;  // tokens order[first : first + count]
    std::vector<int32_t> rows;   // the active rows of A[slot] (q R + j for j < ranks[slot, q])
};

template <typename T, typename TO>
static void run(const T* x, int64_t ldx, TO* out, int64_t ldo, const int64_t* slots, int64_t Tn, const T* A,
                const T* Bt, const int32_t* ranks, const int64_t* slices, int64_t L, int64_t S, int64_t R, int64_t I,
                int64_t Ob, int64_t threads) {
    const int64_t SR = S * R;
    // tokens grouped by slot (a counting sort: tokens keep their order within a slot)
    static thread_local std::vector<int64_t> count, fill, order;
    static thread_local std::vector<float> ybuf;
    count.assign(L + 1, 0);
    for (int64_t t = 0; t < Tn; ++t)
        if (slots[t] >= 0 && slots[t] < L) ++count[slots[t] + 1];
    for (int64_t l = 0; l < L; ++l) count[l + 1] += count[l];
    order.resize(count[L]);
    fill.assign(count.begin(), count.end() - 1);
    for (int64_t t = 0; t < Tn; ++t)
        if (slots[t] >= 0 && slots[t] < L) order[fill[slots[t]]++] = t;
    const int64_t* ord = order.data();  // the OpenMP threads below must not name this thread's thread_locals
    std::vector<Group> groups;
    int64_t work = 0;  // multiply-adds
    for (int64_t l = 0; l < L; ++l) {
        const int64_t n = count[l + 1] - count[l];
        if (!n) continue;
        Group g{l, count[l], n, {}};
        int64_t expand_cols_r = 0;
        for (int64_t q = 0; q < S; ++q) {
            const int64_t r = std::min<int64_t>(std::max<int32_t>(ranks[l * S + q], 0), R);
            for (int64_t j = 0; j < r; ++j) g.rows.push_back(int32_t(q * R + j));
            expand_cols_r += r * slices[2 * q + 1];
        }
        if (g.rows.empty()) continue;
        work += n * (int64_t(g.rows.size()) * I + expand_cols_r);
        groups.push_back(std::move(g));
    }
    if (groups.empty()) return;
    if ((int64_t)ybuf.size() < Tn * SR) ybuf.resize(Tn * SR);
    float* Y = ybuf.data();  // y[t, q R + j]: float32 [T, S R], only the active entries written and read

    struct Unit {
        int32_t g;
        int64_t a, b;  // shrink: token chunk start (in the group), first row; expand: slice, first column
    };
    std::vector<Unit> shrink_units, expand_units;
    for (int32_t gi = 0; gi < (int32_t)groups.size(); ++gi)
        for (int64_t t0 = 0; t0 < groups[gi].count; t0 += kTokenChunk)
            for (int64_t j0 = 0; j0 < (int64_t)groups[gi].rows.size(); j0 += kRowBlock)
                shrink_units.push_back({gi, t0, j0});
    for (int64_t q = 0; q < S; ++q)
        for (int64_t c0 = 0; c0 < slices[2 * q + 1]; c0 += kColBlock) expand_units.push_back({0, q, c0});

    const int64_t nt = std::max<int64_t>(1, std::min(threads, work / kMinPerThread));
    const int64_t n_shrink = shrink_units.size(), n_expand = expand_units.size();
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < n_shrink; ++u) {
            const Group& g = groups[shrink_units[u].g];
            const int64_t t0 = shrink_units[u].a, j0 = shrink_units[u].b;
            const int64_t t1 = std::min(g.count, t0 + kTokenChunk);
            const int64_t nrows = std::min<int64_t>(kRowBlock, g.rows.size() - j0);
            const T* slot_a = A + g.slot * SR * I;
            const int32_t* rows = g.rows.data() + j0;
            int64_t t = t0;
            for (; t + 4 <= t1; t += 4) {
                const T* xs[4];
                float* ys[4];
                for (int i = 0; i < 4; ++i) {
                    const int64_t tok = ord[g.first + t + i];
                    xs[i] = x + tok * ldx;
                    ys[i] = Y + tok * SR;
                }
                dots_rows<T, 4>(xs, slot_a, I, ys, rows, nrows);
            }
            for (; t < t1; ++t) {
                const int64_t tok = ord[g.first + t];
                const T* xs[1] = {x + tok * ldx};
                float* ys[1] = {Y + tok * SR};
                dots_rows<T, 1>(xs, slot_a, I, ys, rows, nrows);
            }
        }
        // the implicit barrier of the loop above: every y is written before the expand reads it
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < n_expand; ++u) {
            const int64_t q = expand_units[u].a, c0 = expand_units[u].b;
            const int64_t col = slices[2 * q] + c0, n = std::min(kColBlock, slices[2 * q + 1] - c0);
            for (const Group& g : groups) {
                const int64_t r = std::min<int64_t>(std::max<int32_t>(ranks[g.slot * S + q], 0), R);
                if (!r) continue;
                const T* b = Bt + g.slot * R * Ob + col;  // [r, n] of the slot's Bt, rows Ob apart
                int64_t t = 0;
                for (; t + 2 <= g.count; t += 2) {
                    const int64_t t_a = ord[g.first + t], t_b = ord[g.first + t + 1];
                    const float* ys[2] = {Y + t_a * SR + q * R, Y + t_b * SR + q * R};
                    TO* os[2] = {out + t_a * ldo + col, out + t_b * ldo + col};
                    expand_cols<T, TO, 2>(ys, r, b, Ob, os, n);
                }
                if (t < g.count) {
                    const int64_t tok = ord[g.first + t];
                    const float* ys[1] = {Y + tok * SR + q * R};
                    TO* os[1] = {out + tok * ldo + col};
                    expand_cols<T, TO, 1>(ys, r, b, Ob, os, n);
                }
            }
        }
    }
}

}  // namespace lora

// x [T, I] (rows ldx apart), out [T, *] (rows ldo apart), slots [T] int64; A [L, S R, I] and Bt [L, R, Ob]
// contiguous, in x's dtype; ranks [L, S] int32; slices [S, 2] int64 (column offset, width) in out and Bt.
// dtype: 0 float32, 1 bfloat16 (x, A, Bt); out_f32: out is float32 whatever x's dtype (a delta buffer), else it
// has x's dtype.
extern "C" void kernel(const void* x, int64_t ldx, void* out, int64_t ldo, const int64_t* slots, int64_t T,
                       const void* a, const void* b, const int32_t* ranks, const int64_t* slices, int64_t L, int64_t S,
                       int64_t R, int64_t I, int64_t Ob, int64_t dtype, int64_t out_f32, int64_t threads) {
    using lora::bf16;
    if (dtype == 0)
        lora::run<float, float>((const float*)x, ldx, (float*)out, ldo, slots, T, (const float*)a, (const float*)b,
                                ranks, slices, L, S, R, I, Ob, threads);
    else if (out_f32)
        lora::run<bf16, float>((const bf16*)x, ldx, (float*)out, ldo, slots, T, (const bf16*)a, (const bf16*)b, ranks,
                               slices, L, S, R, I, Ob, threads);
    else
        lora::run<bf16, bf16>((const bf16*)x, ldx, (bf16*)out, ldo, slots, T, (const bf16*)a, (const bf16*)b, ranks,
                              slices, L, S, R, I, Ob, threads);
}
