// Paged decode attention for CPU (see vlserve/kernels/cpu_decode.py); built through inductor's C++ toolchain.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

using fVec = at::vec::Vectorized<float>;
using bf16 = c10::BFloat16;
using fp8 = c10::Float8_e4m3fn;  // FP8 KV caches: one byte per element, scaled per layer (k_scale / v_scale)
constexpr float kFp8Max = 448.f;  // the largest finite e4m3 value
constexpr int64_t kMaxVecs = 32;  // vectors in a row of up to 256 floats (AVX2: 8 lanes)

// fVec::size() consecutive elements as float32
static inline fVec load(const float* p) { return fVec::loadu(p); }
static inline fVec load(const bf16* p) {
    fVec out;
    at::vec::load_fp32_from_bf16(p, out);
    return out;
}

// fVec::size() float8_e4m3fn bytes as float32, exactly, in registers: a byte sign-extended to 16 bits, shifted left by
// 7 and with bit 14 cleared is the IEEE half with the same sign, exponent field and mantissa (bits 15 | 13..10 | 9..7)
// whose value is the e4m3 value / 256 (half's exponent bias is 15, e4m3's 7; subnormals map onto subnormals); the
// two NaN codes (0x7f, 0xff) get half's all-ones exponent; the hardware widens the halves, and * 256 is exact
static inline fVec load(const fp8* p) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
    const __m256i mag = _mm256_set1_epi16(0x3F80);
    h = _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h, mag), mag),
                                            _mm256_set1_epi16(0x7C00)));
    return fVec(_mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f)));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    __m128i h = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
    const __m128i mag = _mm_set1_epi16(0x3F80);
    h = _mm_or_si128(h, _mm_and_si128(_mm_cmpeq_epi16(_mm_and_si128(h, mag), mag), _mm_set1_epi16(0x7C00)));
    return fVec(_mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f)));
#else
    float f[kMaxVecs];
    for (int64_t i = 0; i < fVec::size(); ++i) f[i] = static_cast<float>(p[i]);
    return fVec::loadu(f);
#endif
}

// one position's keys or values (n elements) into the cache: copied as they are, or, into an FP8 cache, divided by
// the scale, clamped to +-448 and rounded to the nearest e4m3 value (ties to even, as torch's cast rounds)
template <typename T, typename C>
static inline void store_row(C* dst, const T* src, int64_t n, float scale) {
    if constexpr (std::is_same_v<T, C>) {
        std::memcpy(dst, src, n * sizeof(T));
    } else {
        for (int64_t i = 0; i < n; ++i) dst[i] = C(std::clamp(static_cast<float>(src[i]) / scale, -kFp8Max, kFp8Max));
    }
}

// fVec::size() float32 values to consecutive elements (bf16: rounded to nearest even, as static_cast rounds)
static inline void store(float* p, const fVec& v) { v.store(p); }
static inline void store(bf16* p, const fVec& v) { at::vec::convert_from_float<bf16>(v, v).store(p, fVec::size()); }

// sums[j] = the sum of the lanes of the j-th of 8 consecutive vectors at `v`: one shuffle tree for all eight
// rather than eight horizontal reductions
static inline void reduce8(const fVec* v, float* sums) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    __m256 h[8];
    for (int j = 0; j < 8; ++j) {
#if defined(CPU_CAPABILITY_AVX512)
        const __m512 x = v[j];  // fold the upper 256 bits onto the lower
        h[j] = _mm256_add_ps(_mm512_castps512_ps256(x),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
#else
        h[j] = v[j];
#endif
    }
    const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
    _mm256_storeu_ps(sums, _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                                         _mm256_permute2f128_ps(h0123, h4567, 0x31)));
#else
    for (int j = 0; j < 8; ++j) sums[j] = v[j].reduce_add();
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
// How score_rows_512 multiplies query rows with key rows. FmaDot: float32 FMAs on 16 lanes, keys widened to float32
// as they are loaded, the query already scaled.
struct FmaDot {
    using QElem = float;
    using QVec = __m512;
    static constexpr int64_t kLanes = 16;
    static constexpr bool kScaleAfter = false;
    static inline __m512 load_q(const float* p) { return _mm512_loadu_ps(p); }
    template <typename T>
    static inline __m512 load_k(const T* p) { return load(p); }
    static inline __m512 dot(__m512 acc, __m512 q, __m512 k) { return _mm512_fmadd_ps(q, k, acc); }
};
#if defined(__AVX512BF16__)
// Bf16PairDot (bf16 caches on CPUs with AVX512-BF16; the source is then built for that target): vdpbf16ps on the
// raw bf16 rows, 32 elements a step, products of pairs summed in float32 with no widening; the query is the raw
// bf16 row and the sums are scaled after their reduction.
struct Bf16PairDot {
    using QElem = bf16;
    using QVec = __m512bh;
    static constexpr int64_t kLanes = 32;
    static constexpr bool kScaleAfter = true;
    static inline __m512bh load_q(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
    static inline __m512bh load_k(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
    static inline __m512 dot(__m512 acc, __m512bh q, __m512bh k) { return _mm512_dpbf16_ps(acc, q, k); }
};
#endif

// score_rows for rows of NQ (a constant) vectors of Dot::kLanes, on raw registers: GCC keeps arrays of at::vec
// objects in memory, storing every element back on each position
template <typename Dot, typename T, int64_t NQ, int64_t P>
static inline void score_rows_512(const typename Dot::QElem* q, const T* kh, int64_t pos_stride, int64_t n, float* s,
                                  int64_t stride, float scale) {
    constexpr int64_t D = NQ * Dot::kLanes;
    typename Dot::QVec qv[P][NQ];
    for (int64_t p = 0; p < P; ++p)
        for (int64_t v = 0; v < NQ; ++v) qv[p][v] = Dot::load_q(q + p * D + v * Dot::kLanes);
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
        const int64_t n8 = std::min<int64_t>(8, n - t0);
        fVec dots[P][8];
        for (int64_t j = 0; j < 8; ++j) {
            __m512 d[P];
            for (int64_t p = 0; p < P; ++p) d[p] = _mm512_setzero_ps();
            if (j < n8)
                for (int64_t v = 0; v < NQ; ++v) {  // each key vector is loaded once for the P rows
                    const auto k = Dot::load_k(kh + (t0 + j) * pos_stride + v * Dot::kLanes);
                    for (int64_t p = 0; p < P; ++p) d[p] = Dot::dot(d[p], qv[p][v], k);
                }
            for (int64_t p = 0; p < P; ++p) dots[p][j] = fVec(d[p]);
        }
        for (int64_t p = 0; p < P; ++p) {
            float* sp = s + p * stride + t0;
            reduce8(dots[p], sp);
            if constexpr (Dot::kScaleAfter) _mm256_storeu_ps(sp, _mm256_mul_ps(_mm256_loadu_ps(sp), _mm256_set1_ps(scale)));
        }
    }
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// accumulate_rows for rows of NV (a constant) vectors with AVX-512, on raw __m512 registers: GCC keeps an array
// of at::vec objects in memory, storing every accumulator back on each position
template <typename T, int64_t NV, int64_t P>
static inline void accumulate_rows_512(float* acc, const T* vh, int64_t pos_stride, int64_t n, const float* s,
                                       int64_t stride) {
    __m512 a[P][NV];
    for (int64_t p = 0; p < P; ++p)
        for (int64_t v = 0; v < NV; ++v) a[p][v] = _mm512_loadu_ps(acc + p * NV * 16 + v * 16);
    for (int64_t t = 0; t < n; ++t) {
        __m512 prob[P];
        for (int64_t p = 0; p < P; ++p) prob[p] = _mm512_set1_ps(s[p * stride + t]);
        for (int64_t v = 0; v < NV; ++v) {  // each value vector is loaded once for the P rows
            const __m512 x = load(vh + t * pos_stride + v * 16);
            for (int64_t p = 0; p < P; ++p) a[p][v] = _mm512_fmadd_ps(prob[p], x, a[p][v]);
        }
    }
    for (int64_t p = 0; p < P; ++p)
        for (int64_t v = 0; v < NV; ++v) _mm512_storeu_ps(acc + p * NV * 16 + v * 16, a[p][v]);
}
#endif

// scores of P query rows (D apart in qf, already scaled) against n key rows (pos_stride apart from kh), eight
// positions at a time: s[p * stride + t] for t < n (up to the next multiple of 8 is written)
template <typename T, int64_t NV, int64_t P>
static inline void score_rows(const float* qf, const T* kh, int64_t pos_stride, int64_t n, int64_t V, float* s,
                              int64_t stride) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (NV > 0) {
        score_rows_512<FmaDot, T, NV, P>(qf, kh, pos_stride, n, s, stride, 1.f);
        return;
    }
#endif
    const int64_t W = fVec::size(), nv = NV > 0 ? NV : V, D = nv * W;
    fVec qv[P][NV > 0 ? NV : kMaxVecs];  // sized exactly where NV is known: fVec() zero-fills
    for (int64_t p = 0; p < P; ++p)
        for (int64_t v = 0; v < nv; ++v) qv[p][v] = fVec::loadu(qf + p * D + v * W);
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
        const int64_t n8 = std::min<int64_t>(8, n - t0);
        fVec dots[P][8];
        for (int64_t j = 0; j < 8; ++j) {
            for (int64_t p = 0; p < P; ++p) dots[p][j] = fVec(0.f);
            if (j >= n8) continue;
            for (int64_t v = 0; v < nv; ++v) {  // each key vector is loaded once for the P rows
                const fVec k = load(kh + (t0 + j) * pos_stride + v * W);
                for (int64_t p = 0; p < P; ++p) dots[p][j] = at::vec::fmadd(qv[p][v], k, dots[p][j]);
            }
        }
        for (int64_t p = 0; p < P; ++p) reduce8(dots[p], s + p * stride + t0);
    }
}

// acc (P rows, D apart) += the first n probabilities of each row (stride apart in s) times the value rows
// (pos_stride apart from vh); the accumulators stay in registers over the block
template <typename T, int64_t NV, int64_t P>
static inline void accumulate_rows(float* acc, const T* vh, int64_t pos_stride, int64_t n, int64_t V,
                                   const float* s, int64_t stride) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (NV > 0) {
        accumulate_rows_512<T, NV, P>(acc, vh, pos_stride, n, s, stride);
        return;
    }
#endif
    const int64_t W = fVec::size(), nv = NV > 0 ? NV : V, D = nv * W;
    fVec a[P][NV > 0 ? NV : kMaxVecs];
    for (int64_t p = 0; p < P; ++p)
        for (int64_t v = 0; v < nv; ++v) a[p][v] = fVec::loadu(acc + p * D + v * W);
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t v = 0; v < nv; ++v) {  // each value vector is loaded once for the P rows
            const fVec x = load(vh + t * pos_stride + v * W);
            for (int64_t p = 0; p < P; ++p) a[p][v] = at::vec::fmadd(fVec(s[p * stride + t]), x, a[p][v]);
        }
    }
    for (int64_t p = 0; p < P; ++p)
        for (int64_t v = 0; v < nv; ++v) a[p][v].store(acc + p * D + v * W);
}

// q: [B, Hq, D] rows q_stride apart; out: [B, Hq, D]; key, value: [T, Hkv, D] rows k_stride and v_stride apart,
// written into kc, vc: [NB, BS, Hkv, D] at slots [T] (-1: skip) before any row is read; tables: [S, M] int32;
// lens: [B] int32, the positions row b attends to (0 .. lens[b] - 1); row_seq: [B] int32, the table row of each
// query row (several rows of one sequence: its new tokens, each with its own causal length), or null: row b reads
// table row b; D % fVec::size() == 0 and D / fVec::size() <= kMaxVecs. window > 0: sliding-window attention, row b
// attends only to positions lens[b] - window .. lens[b] - 1 (blocks wholly below are skipped, the rest masked).
// C: the caches' element type, T or fp8
// (then keys and values are stored divided by k_scale / v_scale, and read back times them: k_scale is folded
// into the scaled query rows, v_scale into the final normalization)
template <typename T, typename C, int64_t NV>
static void step(const T* q, int64_t q_stride, const T* key, const T* value, int64_t k_stride, int64_t v_stride,
                 const int64_t* slots, int64_t num_writes, C* kc, C* vc, const int32_t* tables, const int32_t* lens,
                 const int32_t* row_seq, T* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t M, float scale,
                 float k_scale, float v_scale, int64_t threads, bool dp_bf16, int64_t window) {
    const int64_t G = Hq / Hkv;
    const int64_t W = fVec::size();
    const int64_t V = NV > 0 ? NV : D / W;  // vectors per row (a constant where NV > 0)
    const int64_t pos_stride = Hkv * D;  // elements between consecutive positions
    const int64_t CB = std::max<int64_t>(1, 256 / BS);  // blocks per chunk: one softmax update per ~256 positions
    const int64_t SC = CB * BS + 8;  // a chunk's scores per row, with room for the last group of eight
    // query rows scored (PS) and accumulated (PV) together: as many as their registers allow
    constexpr int64_t PS = (NV > 0 && NV <= 4) ? 2 : 1;
    constexpr int64_t PV = NV > 0 && NV <= 4 ? 4 : NV > 0 && NV <= 8 ? 2 : 1;
    // A task is one sequence and a group of its KV heads: all of them when there are sequences enough to keep
    // the threads busy (each cache line of a position is then read by one task), fewer for small batches.
    int64_t group = Hkv;
    while (group % 2 == 0 && B * (Hkv / group) < 2 * threads) group /= 2;
    const int64_t R = group * G;  // query rows per task; row r reads KV head h0 + r / G
    const int64_t tasks = B * (Hkv / group);
    const float q_scale = scale * k_scale;  // scores of dequantized keys: (q * scale * k_scale) . k_stored
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_writes; ++i) {  // this step's keys and values first: decodes attend to them
            if (slots[i] < 0) continue;
            store_row(kc + slots[i] * pos_stride, key + i * k_stride, pos_stride, k_scale);
            store_row(vc + slots[i] * pos_stride, value + i * v_stride, pos_stride, v_scale);
        }
        // per thread: the query rows (scaled), their accumulators, running max and sum, a block's scores, and
        // the partial dot products of eight positions before their reduction
        // (not zeroed: every value is written before it is read; the accumulators are cleared per task)
        std::unique_ptr<float[]> scratch(new float[R * (2 * D + 2 + SC)]);
        float* const qf = scratch.get();
        float* const acc = qf + R * D;
        float* const m = acc + R * D;
        float* const l = m + R;
        float* const s = l + R;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t b = task / (Hkv / group), h0 = task % (Hkv / group) * group;
            const int64_t len = lens[b], seq = row_seq ? row_seq[b] : b;  // this row's context and table row
            const T* qb = q + b * q_stride + h0 * G * D;  // the task's R query rows are consecutive
            for (int64_t r = 0; r < R; ++r) {
                for (int64_t d = 0; d < D; d += W) (load(qb + r * D + d) * fVec(q_scale)).store(&qf[r * D + d]);
                m[r] = -FLT_MAX;
                l[r] = 0.f;
            }
            for (int64_t i = 0; i < R * D; i += W) fVec(0.f).store(acc + i);
            const int64_t nblk = (len + BS - 1) / BS;
            const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;  // the first position attended
            const int64_t blk0 = lo / BS;  // blocks below it are never read
            for (int64_t c0 = blk0; c0 < nblk; c0 += CB) {  // a chunk of CB blocks: scores, one softmax update, values
                const int64_t c1 = std::min(nblk, c0 + CB);
                const int64_t npos = std::min(len, c1 * BS) - c0 * BS;
                for (int64_t blk = c0; blk < c1; ++blk) {  // scores: PS query rows of a head at a time
                    const int64_t offset = static_cast<int64_t>(tables[seq * M + blk]) * BS * pos_stride + h0 * D;
                    const int64_t n = std::min(BS, len - blk * BS);
                    for (int64_t r = 0; r < R; r += (r % G + PS <= G ? PS : 1)) {
                        const C* kh = kc + offset + (r / G) * D;
                        float* sr = &s[r * SC + (blk - c0) * BS];
                        const int64_t P = r % G + PS <= G ? PS : 1;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
                        if constexpr (std::is_same_v<C, bf16> && NV > 0 && NV % 2 == 0) {
                            if (dp_bf16) {
                                const bf16* qr = qb + r * D;
                                if (P == PS) score_rows_512<Bf16PairDot, T, NV / 2, PS>(qr, kh, pos_stride, n, sr, SC, scale);
                                else score_rows_512<Bf16PairDot, T, NV / 2, 1>(qr, kh, pos_stride, n, sr, SC, scale);
                                continue;
                            }
                        }
#endif
                        if (P == PS) score_rows<C, NV, PS>(&qf[r * D], kh, pos_stride, n, V, sr, SC);
                        else score_rows<C, NV, 1>(&qf[r * D], kh, pos_stride, n, V, sr, SC);
                    }
                }
                if (c0 == blk0 && lo > c0 * BS)  // positions of the first block below the window: weight 0
                    for (int64_t r = 0; r < R; ++r)
                        for (int64_t t = 0; t < lo - c0 * BS; ++t) s[r * SC + t] = -INFINITY;
                for (int64_t r = 0; r < R; ++r) {  // online softmax: rescale what came before to the new max
                    float* sr = &s[r * SC];
                    fVec vmax(-FLT_MAX);
                    int64_t t = 0;
                    for (; t + W <= npos; t += W) vmax = at::vec::maximum(vmax, fVec::loadu(sr + t));
                    float mx = std::max(m[r], vmax.reduce_max());
                    for (; t < npos; ++t) mx = std::max(mx, sr[t]);
                    fVec vsum(0.f);
                    for (t = 0; t + W <= npos; t += W) {  // whole vectors of scores
                        const fVec e = (fVec::loadu(sr + t) - fVec(mx)).exp();
                        e.store(sr + t);
                        vsum = vsum + e;
                    }
                    float sum = vsum.reduce_add();
                    for (; t < npos; ++t) {  // the ragged end
                        sr[t] = std::exp(sr[t] - mx);
                        sum += sr[t];
                    }
                    const float corr = std::exp(m[r] - mx);  // 0 on the first chunk (m = -FLT_MAX)
                    l[r] = l[r] * corr + sum;
                    m[r] = mx;
                    if (corr != 1.f)
                        for (int64_t d = 0; d < D; d += W) (fVec::loadu(&acc[r * D + d]) * fVec(corr)).store(&acc[r * D + d]);
                }
                for (int64_t blk = c0; blk < c1; ++blk) {  // values: PV query rows of a head at a time
                    const int64_t offset = static_cast<int64_t>(tables[seq * M + blk]) * BS * pos_stride + h0 * D;
                    const int64_t n = std::min(BS, len - blk * BS);
                    for (int64_t r = 0; r < R; r += (r % G + PV <= G ? PV : 1)) {
                        const C* vh = vc + offset + (r / G) * D;
                        const float* sr = &s[r * SC + (blk - c0) * BS];
                        if (r % G + PV <= G) accumulate_rows<C, NV, PV>(&acc[r * D], vh, pos_stride, n, V, sr, SC);
                        else accumulate_rows<C, NV, 1>(&acc[r * D], vh, pos_stride, n, V, sr, SC);
                    }
                }
            }
            for (int64_t r = 0; r < R; ++r) {
                const fVec inv(l[r] > 0.f ? v_scale / l[r] : 0.f);
                T* orow = out + (b * Hq + h0 * G + r) * D;
                for (int64_t d = 0; d < D; d += W) store(orow + d, fVec::loadu(&acc[r * D + d]) * inv);
            }
        }
    }
}

template <typename T, typename C>
static void step_typed(const void* q, int64_t q_stride, const void* key, const void* value, int64_t k_stride, int64_t v_stride,
                       const int64_t* slots, int64_t num_writes, void* kc, void* vc, const int32_t* tables,
                       const int32_t* lens, const int32_t* row_seq, void* out, int64_t B, int64_t Hq, int64_t Hkv,
                       int64_t D, int64_t BS, int64_t M, float scale, float k_scale, float v_scale, int64_t threads,
                       bool dp_bf16, int64_t window) {
    // rows of 4 or 8 vectors (head dim 64 or 128 with AVX-512) get code with their loops unrolled into registers
    auto run = [&](auto nv) {
        step<T, C, decltype(nv)::value>(static_cast<const T*>(q), q_stride, static_cast<const T*>(key),
                                        static_cast<const T*>(value), k_stride, v_stride, slots, num_writes,
                                        static_cast<C*>(kc), static_cast<C*>(vc), tables, lens, row_seq,
                                        static_cast<T*>(out), B, Hq, Hkv, D, BS, M, scale, k_scale, v_scale, threads,
                                        dp_bf16, window);
    };
    const int64_t V = D / fVec::size();
    if (V == 4) run(std::integral_constant<int64_t, 4>());
    else if (V == 8) run(std::integral_constant<int64_t, 8>());
    else run(std::integral_constant<int64_t, 0>());
}

// is_bf16: the query, key, value and output dtype (else float32); cache_fp8: the caches hold float8_e4m3fn scaled
// by k_scale / v_scale (else the query's dtype, and the scales are 1); window: the sliding window (0: none)
extern "C" void kernel(const void* q, int64_t q_stride, const void* key, const void* value, int64_t k_stride, int64_t v_stride,
                       const int64_t* slots, int64_t num_writes, void* kc, void* vc, const int32_t* tables,
                       const int32_t* lens, const int32_t* row_seq, int64_t has_row_seq, void* out, int64_t B,
                       int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t M, float scale, int64_t threads,
                       int64_t is_bf16, int64_t dp_bf16, float k_scale, float v_scale, int64_t cache_fp8,
                       int64_t window) {
    if (!has_row_seq) row_seq = nullptr;
    auto run = [&](auto typed) {
        typed(q, q_stride, key, value, k_stride, v_stride, slots, num_writes, kc, vc, tables, lens, row_seq, out, B, Hq,
              Hkv, D, BS, M, scale, k_scale, v_scale, threads, is_bf16 && dp_bf16 != 0, window);
    };
    if (is_bf16 && cache_fp8) run(step_typed<bf16, fp8>);
    else if (is_bf16) run(step_typed<bf16, bf16>);
    else if (cache_fp8) run(step_typed<float, fp8>);
    else run(step_typed<float, float>);
}
