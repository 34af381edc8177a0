// Attention of segments (causal or bidirectional): see vlserve/kernels/varlen_attention_cpu.py.
// One OpenMP task per (segment, KV head). bf16 heads go to attention_pairs.h (zero-padded to a multiple of 32) where
// the build has AMX-BF16 or AVX512-BF16. Otherwise (the widened path) its keys (rows of k, or positions of a paged cache) are
// widened to float32 and transposed into Kt [D][L] and its values into Vf [L][D], then each query head of its group
// takes its rows kRows at a time (eight on AVX-512, four elsewhere): the rows' scores over the keys they see (vectors
// along the keys, the rows sharing each Kt load), a float32 softmax (AVX-512: its weights unnormalized, each row's
// output scaled by the inverse of their sum as it is stored), then the weighted sum of values (a few vectors
// along D a pass, the rows sharing each value load and each row's weight broadcast shared by those vectors).
// Nothing is read past a segment's end, and a row's result depends only on its query and the keys it sees (not on the
// rows it shares a block with).
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#include "vec_bf16.h"
#include "vec_exp2.h"
#include "attention_pairs.h"

namespace {

using Vec = at::vec::Vectorized<float>;
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kRows = 8;  // query rows that share each key / value load
#else
constexpr int64_t kRows = 4;
#endif

inline int64_t whole_vectors(int64_t n) { return (n + Vec::size() - 1) / Vec::size() * Vec::size(); }

// src row r (row stride `stride` elements), D contiguous elements -> dst float32 [D], times `scale`
inline void widen_row(const void* src, int64_t offset, int64_t D, bool bf16, float scale, float* dst) {
    if (bf16) {
        const auto* s = static_cast<const c10::BFloat16*>(src) + offset;
        int64_t d = 0;
        for (; d + Vec::size() <= D; d += Vec::size())
            (at::vec::convert<float>(at::vec::Vectorized<c10::BFloat16>::loadu(s + d, Vec::size())) * Vec(scale))
                .store(dst + d);
        for (; d < D; ++d) dst[d] = static_cast<float>(s[d]) * scale;
    } else {
        const float* s = static_cast<const float*>(src) + offset;
        int64_t d = 0;
        for (; d + Vec::size() <= D; d += Vec::size()) (Vec::loadu(s + d) * Vec(scale)).store(dst + d);
        for (; d < D; ++d) dst[d] = s[d] * scale;
    }
}

// src [D] times `factor` -> out at offset, as float32 or rounded to bf16
inline void store_row(const float* src, int64_t D, float factor, bool bf16, void* out, int64_t offset) {
    const Vec f(factor);
    int64_t d = 0;
    if (bf16) {
        auto* o = static_cast<c10::BFloat16*>(out) + offset;
        for (; d + Vec::size() <= D; d += Vec::size()) vec_bf16::store_bf16(o + d, Vec::loadu(src + d) * f);
        for (; d < D; ++d) o[d] = c10::BFloat16(src[d] * factor);
    } else {
        float* o = static_cast<float*>(out) + offset;
        for (; d + Vec::size() <= D; d += Vec::size()) (Vec::loadu(src + d) * f).store(o + d);
        for (; d < D; ++d) o[d] = src[d] * factor;
    }
}

// A row's weights: scores s[0..n) (n >= 1, the query already scaled) -> in place, weights proportional to the
// softmax's, zero in [n, whole vectors) (s has room for them); returns the factor that normalizes them (their weighted
// sum of values times it is the row's output). AVX-512: 2^(log2(e) (s - max)) by a float32-precise polynomial,
// unnormalized; elsewhere the softmax itself (factor 1).
inline float row_weights(float* s, int64_t n) {
    const int64_t nv = whole_vectors(n);
    std::fill(s + n, s + nv, -std::numeric_limits<float>::infinity());
#if defined(CPU_CAPABILITY_AVX512)
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < nv; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
    const __m512 log2e = _mm512_set1_ps(1.44269504f), mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < nv; j += 16) {  // (s - max exact where it matters, then in log2 units)
        const __m512 t = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), mx), log2e);
        const __m512 e = vec_exp2::exp2_nonpositive_f32(t);
        _mm512_storeu_ps(s + j, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    return 1.0f / _mm512_reduce_add_ps(vsum);
#else
    Vec vmax(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < nv; j += Vec::size()) vmax = at::vec::maximum(vmax, Vec::loadu(s + j));
    const Vec mx(at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmax));
    Vec vsum(0.0f);
    for (int64_t j = 0; j < nv; j += Vec::size()) {
        const Vec e = (Vec::loadu(s + j) - mx).exp();
        e.store(s + j);
        vsum = vsum + e;
    }
    const Vec inv(1.0f / at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum));
    for (int64_t j = 0; j < nv; j += Vec::size()) (Vec::loadu(s + j) * inv).store(s + j);
    return 1.0f;
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
// AVX-512 (32 vector registers): eight query rows a block, on raw registers (GCC keeps arrays of at::vec objects in
// memory). Each element's sum runs in the same order as on the portable path below.

// scores[r][0..n) = q[r] . Kt[:, 0..n) for the kRows query rows q [kRows][D] (already scaled); Kt [D][ld], ld a whole
// number of vector pairs >= n (zero past the keys), so every load is whole; two vectors of keys a pass share each
// query element's broadcast
void scores_block(const float* q, const float* kt, int64_t ld, int64_t D, int64_t n, float* scores) {
    for (int64_t j = 0; j < n; j += 32) {
        __m512 a[kRows], b[kRows];
        for (int r = 0; r < kRows; ++r) a[r] = b[r] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; ++d) {
            const __m512 k0 = _mm512_loadu_ps(kt + d * ld + j), k1 = _mm512_loadu_ps(kt + d * ld + j + 16);
            for (int r = 0; r < kRows; ++r) {
                const __m512 x = _mm512_set1_ps(q[r * D + d]);
                a[r] = _mm512_fmadd_ps(x, k0, a[r]);
                b[r] = _mm512_fmadd_ps(x, k1, b[r]);
            }
        }
        for (int r = 0; r < kRows; ++r) {
            _mm512_storeu_ps(scores + r * ld + j, a[r]);
            _mm512_storeu_ps(scores + r * ld + j + 16, b[r]);
        }
    }
}

// acc[r][d0 .. d0 + 16 NV) = sum_j p[r][j] * Vf[j][...] over j < n for the kRows rows
template <int NV>
inline void weighted_values_block(const float* p, int64_t sld, int64_t n, const float* vf, int64_t D, int64_t d0,
                                  float* acc) {
    __m512 a[kRows][NV];
    for (int r = 0; r < kRows; ++r)
        for (int u = 0; u < NV; ++u) a[r][u] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
        __m512 v[NV];
        for (int u = 0; u < NV; ++u) v[u] = _mm512_loadu_ps(vf + j * D + d0 + 16 * u);
        for (int r = 0; r < kRows; ++r) {
            const __m512 w = _mm512_set1_ps(p[r * sld + j]);
            for (int u = 0; u < NV; ++u) a[r][u] = _mm512_fmadd_ps(w, v[u], a[r][u]);
        }
    }
    for (int r = 0; r < kRows; ++r)
        for (int u = 0; u < NV; ++u) _mm512_storeu_ps(acc + r * D + d0 + 16 * u, a[r][u]);
}

// weighted_values' columns in whole vectors: two vectors a pass, then one; returns the columns done
int64_t weighted_value_vectors(const float* p, int64_t sld, int64_t n, const float* vf, int64_t D, float* acc) {
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) weighted_values_block<2>(p, sld, n, vf, D, d, acc);
    for (; d + 16 <= D; d += 16) weighted_values_block<1>(p, sld, n, vf, D, d, acc);
    return d;
}
#else
// scores[r][0..n) = q[r] . Kt[:, 0..n) for the kRows query rows q [kRows][D] (already scaled); Kt [D][ld], ld a whole
// number of vector pairs >= n (zero past the keys), so every load is whole; two vectors of keys a pass share each
// query element's broadcast
void scores_block(const float* q, const float* kt, int64_t ld, int64_t D, int64_t n, float* scores) {
    constexpr int64_t W = Vec::size();
    for (int64_t j = 0; j < n; j += 2 * W) {
        Vec a0(0.0f), a1(0.0f), a2(0.0f), a3(0.0f), b0(0.0f), b1(0.0f), b2(0.0f), b3(0.0f);
        for (int64_t d = 0; d < D; ++d) {
            const Vec k0 = Vec::loadu(kt + d * ld + j), k1 = Vec::loadu(kt + d * ld + j + W);
            const Vec q0(q[d]), q1(q[D + d]), q2(q[2 * D + d]), q3(q[3 * D + d]);
            a0 = at::vec::fmadd(q0, k0, a0);
            b0 = at::vec::fmadd(q0, k1, b0);
            a1 = at::vec::fmadd(q1, k0, a1);
            b1 = at::vec::fmadd(q1, k1, b1);
            a2 = at::vec::fmadd(q2, k0, a2);
            b2 = at::vec::fmadd(q2, k1, b2);
            a3 = at::vec::fmadd(q3, k0, a3);
            b3 = at::vec::fmadd(q3, k1, b3);
        }
        a0.store(scores + j);
        b0.store(scores + j + W);
        a1.store(scores + ld + j);
        b1.store(scores + ld + j + W);
        a2.store(scores + 2 * ld + j);
        b2.store(scores + 2 * ld + j + W);
        a3.store(scores + 3 * ld + j);
        b3.store(scores + 3 * ld + j + W);
    }
}

// acc[r][d0 .. d0 + NV vectors) = sum_j p[r][j] * Vf[j][...] over j < n for the kRows rows: NV value vectors per key
// share each row's weight broadcast (kRows x NV accumulators)
template <int NV>
inline void weighted_values_block(const float* p, int64_t sld, int64_t n, const float* vf, int64_t D, int64_t d0,
                                  float* acc) {
    constexpr int64_t W = Vec::size();
    Vec a[kRows][NV];
    for (int64_t r = 0; r < kRows; ++r)
        for (int u = 0; u < NV; ++u) a[r][u] = Vec(0.0f);
    for (int64_t j = 0; j < n; ++j) {
        Vec v[NV];
        for (int u = 0; u < NV; ++u) v[u] = Vec::loadu(vf + j * D + d0 + u * W);
        for (int64_t r = 0; r < kRows; ++r) {
            const Vec w(p[r * sld + j]);
            for (int u = 0; u < NV; ++u) a[r][u] = at::vec::fmadd(w, v[u], a[r][u]);
        }
    }
    for (int64_t r = 0; r < kRows; ++r)
        for (int u = 0; u < NV; ++u) a[r][u].store(acc + r * D + d0 + u * W);
}

// weighted_values' columns in whole vectors, two a pass (four where the vectors are of 16 lanes), then one; returns
// the columns done. Each element's sum runs over j in order, whatever the blocking.
int64_t weighted_value_vectors(const float* p, int64_t sld, int64_t n, const float* vf, int64_t D, float* acc) {
    constexpr int64_t W = Vec::size();
    constexpr int NV = W >= 16 ? 4 : 2;
    int64_t d = 0;
    for (; d + NV * W <= D; d += NV * W) weighted_values_block<NV>(p, sld, n, vf, D, d, acc);
    for (; d + W <= D; d += W) weighted_values_block<1>(p, sld, n, vf, D, d, acc);
    return d;
}
#endif

// acc[r][0..D) = sum_j p[r][j] * Vf[j][0..D) over j < n for the kRows rows (p [kRows][sld], zero where a row sees
// no key); Vf [L][D]: whole vectors of columns, then one column at a time
void weighted_values(const float* p, int64_t sld, int64_t n, const float* vf, int64_t D, float* acc) {
    int64_t d = weighted_value_vectors(p, sld, n, vf, D, acc);
    for (; d < D; ++d)
        for (int64_t r = 0; r < kRows; ++r) {
            float s = 0.0f;
            for (int64_t j = 0; j < n; ++j) s += p[r * sld + j] * vf[j * D + d];
            acc[r * D + d] = s;
        }
}

// One (segment, KV head) task on the widened path: keys (row j at key_row(j)) widened to float32 and transposed into
// Kt, values into Vf, then each query head of the group kRows rows at a time (the buffers are the thread's)
template <typename KeyRow>
void widened_task(const void* q, const void* k, const void* v, void* out, int64_t q_ld, int64_t k_ld, int64_t v_ld,
                  int64_t o_ld, int64_t q_start, int64_t Q, int64_t L, int64_t h, int64_t group, int64_t D,
                  float scale, bool causal, bool bf16, KeyRow key_row, std::vector<float> (&buf)[5]) {
    auto& [kt, vf, key, qs, scores] = buf;  // scores [kRows][ld], then the block's sums [kRows][D]
    const int64_t first = L - Q;  // position of the segment's first query
    const int64_t ld = (L + 2 * Vec::size() - 1) / (2 * Vec::size()) * (2 * Vec::size());  // Kt row length
    kt.assign(D * ld, 0.0f);
    vf.resize(L * D);
    key.resize(D);
    qs.resize(kRows * D);
    scores.resize(kRows * ld + kRows * D);
    float* sums = scores.data() + kRows * ld;
    for (int64_t j = 0; j < L; ++j) {
        const int64_t row = key_row(j);
        widen_row(k, row * k_ld + h * D, D, bf16, 1.0f, key.data());
        for (int64_t d = 0; d < D; ++d) kt[d * ld + j] = key[d];
        widen_row(v, row * v_ld + h * D, D, bf16, 1.0f, vf.data() + j * D);
    }
    for (int64_t hq = h * group; hq < (h + 1) * group; ++hq) {
        for (int64_t i0 = 0; i0 < Q; i0 += kRows) {
            const int64_t rows = std::min(kRows, Q - i0);
            const int64_t n_max = causal ? first + i0 + rows : L;  // keys the block's last row sees
            for (int64_t r = 0; r < rows; ++r)
                widen_row(q, (q_start + i0 + r) * q_ld + hq * D, D, bf16, scale, qs.data() + r * D);
            std::fill(qs.begin() + rows * D, qs.end(), 0.0f);  // rows past the segment: never stored
            scores_block(qs.data(), kt.data(), ld, D, n_max, scores.data());
            float factor[kRows];
            for (int64_t r = 0; r < kRows; ++r) {
                const int64_t n = r < rows ? (causal ? first + i0 + r + 1 : L) : 0;
                float* row = scores.data() + r * ld;
                factor[r] = n > 0 ? row_weights(row, n) : 0.0f;  // zero up to whole vectors past n
                const int64_t done = n > 0 ? whole_vectors(n) : 0;
                if (done < n_max) std::fill(row + done, row + n_max, 0.0f);  // unseen keys weigh 0
            }
            weighted_values(scores.data(), ld, n_max, vf.data(), D, sums);
            for (int64_t r = 0; r < rows; ++r)
                store_row(sums + r * D, D, factor[r], bf16, out, (q_start + i0 + r) * o_ld + hq * D);
        }
    }
}

}  // namespace

// vdpbf16ps pads a task to blocks of 32 query rows and 32 keys: below these the widened path is as fast (AVX-512
// EPYC, 2 threads, heads of 64)
constexpr int64_t kDpbf16MinRows = 8, kDpbf16MinKeys = 16;

// Which path bf16 heads take here: 2 AMX tiles, 1 vdpbf16ps, 0 the widened float32 path
static int64_t pairs_engine() {
#if defined(VLSERVE_PAIRS_AMX)
    if (amx_tiles::permitted()) return 2;
#endif
#if defined(VLSERVE_PAIRS_DPBF16)
    return 1;
#else
    return 0;
#endif
}

// q / out [*, Hq, D], k / v [*, Hkv, D]: row strides q_ld / k_ld / v_ld / o_ld elements, head stride D, elements
// contiguous. Segment s: query rows q_starts[s] .. + q_lens[s] of q and out, over kv_lens[s] keys and values: the rows
// kv_starts[s] .. of k / v, or (tables given: k / v are the paged caches [NB, BS, Hkv, D], k_ld = v_ld = Hkv * D)
// positions 0 .. kv_lens[s] - 1 through the block ids tables[kv_starts[s] * M ..]. Query i sits at position
// kv_lens[s] - q_lens[s] + i; causal, it sees keys 0 .. that position, else all of them. S < 0: a probe that writes
// pairs_engine() to out (int64).
extern "C" void kernel(const void* q, const void* k, const void* v, void* out, int64_t q_ld, int64_t k_ld,
                       int64_t v_ld, int64_t o_ld, const int64_t* q_starts, const int64_t* q_lens,
                       const int64_t* kv_starts, const int64_t* kv_lens, const int32_t* tables, int64_t M,
                       int64_t BS, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, float scale, int64_t causal,
                       int64_t is_bf16, int64_t threads) {
    const bool bf16 = is_bf16 != 0;
    const int64_t group = Hq / Hkv;
    const int64_t tasks = S * Hkv;
    if (S < 0) {
        *static_cast<int64_t*>(out) = pairs_engine();
        return;
    }
    const int64_t engine = bf16 ? pairs_engine() : 0;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> buf[5];
#if defined(VLSERVE_PAIRS_AMX) || defined(VLSERVE_PAIRS_DPBF16)
        attention_pairs::Task pairs;
#endif
#if defined(VLSERVE_PAIRS_AMX)
        if (engine == 2) attention_pairs::AmxEngine::thread_begin();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; ++t) {
            const int64_t s = t / Hkv, h = t % Hkv, q_start = q_starts[s], Q = q_lens[s], L = kv_lens[s];
            if (Q <= 0 || L <= 0) continue;
            const int32_t* table = tables ? tables + kv_starts[s] * M : nullptr;
            const int64_t kv0 = kv_starts[s];
            const auto key_row = [=](int64_t j) { return table ? int64_t(table[j / BS]) * BS + j % BS : kv0 + j; };
            const auto* q16 = static_cast<const uint16_t*>(q);
            const auto* k16 = static_cast<const uint16_t*>(k);
            const auto* v16 = static_cast<const uint16_t*>(v);
            auto* o16 = static_cast<c10::BFloat16*>(out);
#if defined(VLSERVE_PAIRS_AMX)
            if (engine == 2) {
                attention_pairs::run<attention_pairs::AmxEngine>(pairs, q16, k16, v16, o16, q_ld, k_ld, v_ld, o_ld,
                                                                 q_start, Q, L, h, h * group, group, D, scale,
                                                                 causal != 0, key_row);
                continue;
            }
#endif
#if defined(VLSERVE_PAIRS_DPBF16)
            if (engine == 1 && Q >= kDpbf16MinRows && L >= kDpbf16MinKeys) {
                attention_pairs::run<attention_pairs::Dpbf16Engine>(pairs, q16, k16, v16, o16, q_ld, k_ld, v_ld,
                                                                    o_ld, q_start, Q, L, h, h * group, group, D,
                                                                    scale, causal != 0, key_row);
                continue;
            }
#endif
            widened_task(q, k, v, out, q_ld, k_ld, v_ld, o_ld, q_start, Q, L, h, group, D, scale, causal != 0, bf16,
                         key_row, buf);
        }
#if defined(VLSERVE_PAIRS_AMX)
        if (engine == 2) attention_pairs::AmxEngine::thread_end();
#endif
    }
}
