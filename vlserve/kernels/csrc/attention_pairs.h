// Segment attention of bf16 heads (D a multiple of 32) on bf16 pair products, for varlen_attention_cpu.cpp. One
// task's keys are packed as the B operand of Q.K^T and its values as the B operand of P.V (AMX's B-tile layout: a row
// per pair of the reduced dimension, 16 columns of bf16 pairs, zero past the keys); a head's query rows are copied
// into 32-row blocks. Scores are float32, the softmax float32, the weights rounded to bf16 (as torch's CPU flash
// attention rounds them for bf16) and multiplied with the values, float32 sums. Two engines run the products: AMX
// tiles, and AVX512-BF16's vdpbf16ps on the same packed rows. A row's result depends only on its query and the keys
// it sees: padding keys and unseen ones weigh exactly 0, and each engine sums a row in the same order whatever rows
// share its block.
#ifndef VLSERVE_ATTENTION_PAIRS_H  // (pasted into one source by cpp_build.kernel_source: a guard, not pragma once)
#define VLSERVE_ATTENTION_PAIRS_H
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#include "vec_bf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_tiles.h"
#define VLSERVE_PAIRS_AMX 1
#endif
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define VLSERVE_PAIRS_DPBF16 1
#endif

#if defined(VLSERVE_PAIRS_AMX) || defined(VLSERVE_PAIRS_DPBF16)
namespace attention_pairs {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kBlock = 32;  // query rows of a block, keys of a score panel / of a P.V step

struct Task {
    std::vector<uint32_t> kb, vb;  // B operands: [key block of 16][D / 32 steps][16 pairs][16] and
                                   // [key step of 32][D / 16 column blocks][16 pairs][16]
    std::vector<uint16_t> qb, pb;  // query rows [Qp][D] (zero past the segment) and a block's weights [32][Lp]
    std::vector<float> scores, acc;  // a block's scores [32][Lp] and sums [32][D]
};

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// One block's sums: sums[32 rows][32 columns] (rows ld floats apart) = A . B over `steps` steps of 16 pairs. A: 32
// rows of bf16 a_ld elements apart, step s at element s * 32 of each row; B: step s's 16 pair rows of columns 0-15 at
// b + s * b_step, of columns 16-31 b_half further (uint32 units, rows 16 apart).
#if defined(VLSERVE_PAIRS_AMX)
struct AmxEngine {
    static void thread_begin() { amx_tiles::configure(); }
    static void thread_end() { _tile_release(); }
    static inline void block(const uint16_t* a, int64_t a_ld, const uint32_t* b, int64_t b_step, int64_t b_half,
                             int64_t steps, float* sums, int64_t ld) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; ++s) {
            _tile_loadd(4, a + s * 32, a_ld * 2);
            _tile_loadd(5, a + 16 * a_ld + s * 32, a_ld * 2);
            _tile_loadd(6, b + s * b_step, 64);
            _tile_loadd(7, b + s * b_step + b_half, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, sums, ld * 4);
        _tile_stored(1, sums + 16, ld * 4);
        _tile_stored(2, sums + 16 * ld, ld * 4);
        _tile_stored(3, sums + 16 * ld + 16, ld * 4);
    }
};
#endif

#if defined(VLSERVE_PAIRS_DPBF16)
// vdpbf16ps: eight rows at a time, each row's pair broadcast against the two 16-column B rows of a pair
struct Dpbf16Engine {
    static void thread_begin() {}
    static void thread_end() {}
    static inline void block(const uint16_t* a, int64_t a_ld, const uint32_t* b, int64_t b_step, int64_t b_half,
                             int64_t steps, float* sums, int64_t ld) {
        constexpr int R = 8;
        for (int64_t r0 = 0; r0 < kBlock; r0 += R) {
            __m512 lo[R], hi[R];
            for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
            const uint16_t* rows = a + r0 * a_ld;
            for (int64_t s = 0; s < steps; ++s) {
                const uint32_t* bs = b + s * b_step;
                for (int64_t p = 0; p < 16; ++p) {
                    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bs + p * 16);
                    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bs + b_half + p * 16);
                    const int64_t e = s * 32 + 2 * p;  // the pair's first element in a row of A
                    for (int r = 0; r < R; ++r) {
                        int32_t pair;
                        std::memcpy(&pair, rows + r * a_ld + e, 4);
                        const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
                        lo[r] = _mm512_dpbf16_ps(lo[r], x, b0);
                        hi[r] = _mm512_dpbf16_ps(hi[r], x, b1);
                    }
                }
            }
            for (int r = 0; r < R; ++r) {
                _mm512_storeu_ps(sums + (r0 + r) * ld, lo[r]);
                _mm512_storeu_ps(sums + (r0 + r) * ld + 16, hi[r]);
            }
        }
    }
};
#endif

// m[16] rows of 16 int32 -> its transpose in place (m[r][c] <- m[c][r])
inline void transpose16(__m512i m[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(m[i], m[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(m[i], m[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // u[i + c]: rows i .. i + 3 at columns c, c + 4, c + 8, c + 12 (lanes)
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; ++c) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        const __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        m[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        m[c + 4] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
        m[c + 8] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        m[c + 12] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
    }
}

// p[0..n) = softmax(scale * s[0..n)) rounded to bf16 (float32 max, ATen's faster exp_u20: the weights are
// rounded to bf16 after it, float32 sum), p[n..Lp) = 0; s has room for whole vectors past n (its tail is overwritten)
inline void softmax_bf16(float* s, int64_t n, int64_t Lp, float scale, uint16_t* p) {
    constexpr int64_t W = Vec::size();
    const int64_t nv = (n + W - 1) / W * W;
    std::fill(s + n, s + nv, -std::numeric_limits<float>::infinity());
    Vec vmax(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < nv; j += W) vmax = at::vec::maximum(vmax, Vec::loadu(s + j));
    const float mx = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, vmax);
    const Vec vscale(scale), shift(mx * scale);
    Vec vsum(0.0f);
    for (int64_t j = 0; j < nv; j += W) {
        const Vec e = at::vec::fmsub(Vec::loadu(s + j), vscale, shift).exp_u20();
        e.store(s + j);
        vsum = vsum + e;
    }
    const Vec inv(1.0f / at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum));
    for (int64_t j = 0; j < nv; j += W) vec_bf16::store_bf16((c10::BFloat16*)(p + j), Vec::loadu(s + j) * inv);
    std::fill(p + nv, p + Lp, uint16_t(0));
}

// The task's keys and values (row j at key_row(j) of k / v, head h at h * D) into t.kb / t.vb
template <typename KeyRow>
void pack_keys_values(Task& t, const uint16_t* k, const uint16_t* v, int64_t k_ld, int64_t v_ld, int64_t L,
                      int64_t h, int64_t D, KeyRow key_row) {
    const int64_t Lp = round_up(L, kBlock), DS = D / 32, DC = D / 16;
    t.kb.resize(Lp * D / 2);
    t.vb.resize(Lp * D / 2);
    const int64_t last = (L - 1) / kBlock * kBlock;  // the last value step: zero, then its values written over
    std::fill(t.vb.begin() + last * D / 2, t.vb.end(), 0u);
    for (int64_t j0 = 0; j0 < Lp; j0 += 16) {  // keys: block (j / 16, step p / 16), row p % 16 (pair p), column j % 16
        const uint16_t* rows[16];
        for (int64_t c = 0; c < 16; ++c) rows[c] = j0 + c < L ? k + key_row(j0 + c) * k_ld + h * D : nullptr;
        for (int64_t ds = 0; ds < DS; ++ds) {
            __m512i block[16];  // key c's pairs 16 ds .. 16 ds + 15 (zero past the keys), then transposed
            for (int64_t c = 0; c < 16; ++c)
                block[c] = rows[c] ? _mm512_loadu_si512(rows[c] + ds * 32) : _mm512_setzero_si512();
            transpose16(block);
            uint32_t* tile = t.kb.data() + ((j0 / 16) * DS + ds) * 256;
            for (int64_t r = 0; r < 16; ++r) _mm512_storeu_si512(tile + r * 16, block[r]);
        }
    }
    for (int64_t j = 0; j < L; j += 2) {  // values: block (step j / 32, columns d / 16), row (j % 32) / 2: pairs
        const uint16_t* v0 = v + key_row(j) * v_ld + h * D;  // (value j, value j + 1) of each d
        const uint16_t* v1 = j + 1 < L ? v + key_row(j + 1) * v_ld + h * D : nullptr;
        uint32_t* vt = t.vb.data() + (j / kBlock) * DC * 256 + ((j % kBlock) / 2) * 16;
        for (int64_t d = 0; d < D; d += 16) {
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v0 + d)));
            const __m512i hi = v1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v1 + d)))
                                  : _mm512_setzero_si512();
            _mm512_storeu_si512(vt + (d / 16) * 256, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

// One (segment, KV head) task: keys / values row j at key_row(j) of k / v (bf16, head h at h * D), query heads hq0
// .. hq0 + group of rows q_start .. q_start + Q; query i at position L - Q + i (causal: it sees keys 0 .. that).
template <typename Engine, typename KeyRow>
void run(Task& t, const uint16_t* q, const uint16_t* k, const uint16_t* v, c10::BFloat16* out, int64_t q_ld,
         int64_t k_ld, int64_t v_ld, int64_t o_ld, int64_t q_start, int64_t Q, int64_t L, int64_t h, int64_t hq0,
         int64_t group, int64_t D, float scale, bool causal, KeyRow key_row) {
    const int64_t Qp = round_up(Q, kBlock), Lp = round_up(L, kBlock), DS = D / 32, DC = D / 16, first = L - Q;
    pack_keys_values(t, k, v, k_ld, v_ld, L, h, D, key_row);
    t.qb.resize(Qp * D);
    t.pb.resize(kBlock * Lp);
    t.scores.resize(kBlock * Lp);
    t.acc.resize(kBlock * D);
    std::fill(t.qb.begin() + Q * D, t.qb.end(), uint16_t(0));
    for (int64_t hq = hq0; hq < hq0 + group; ++hq) {
        for (int64_t i = 0; i < Q; ++i) {
            const uint16_t* row = q + (q_start + i) * q_ld + hq * D;
            std::copy(row, row + D, t.qb.data() + i * D);
        }
        for (int64_t i0 = 0; i0 < Q; i0 += kBlock) {
            const int64_t rows = std::min(kBlock, Q - i0), n_max = causal ? first + i0 + rows : L;
            float* s = t.scores.data();
            for (int64_t j0 = 0; j0 < n_max; j0 += kBlock)  // scores of 32 rows x 32 keys
                Engine::block(t.qb.data() + i0 * D, D, t.kb.data() + (j0 / 16) * DS * 256, 256, DS * 256, DS,
                              s + j0, Lp);
            for (int64_t r = 0; r < rows; ++r)  // the weights in bf16, zero past the row's keys
                softmax_bf16(s + r * Lp, causal ? first + i0 + r + 1 : L, Lp, scale, t.pb.data() + r * Lp);
            std::fill(t.pb.begin() + rows * Lp, t.pb.end(), uint16_t(0));  // rows past the segment: never stored
            for (int64_t d0 = 0; d0 < D; d0 += 32)  // the weighted values: 32 rows x 32 of D
                Engine::block(t.pb.data(), Lp, t.vb.data() + (d0 / 16) * 256, DC * 256, 256,
                              (n_max + kBlock - 1) / kBlock, t.acc.data() + d0, D);
            for (int64_t r = 0; r < rows; ++r) {
                c10::BFloat16* o = out + (q_start + i0 + r) * o_ld + hq * D;
                for (int64_t d = 0; d < D; d += Vec::size())
                    vec_bf16::store_bf16(o + d, Vec::loadu(t.acc.data() + r * D + d));
            }
        }
    }
}

}  // namespace attention_pairs
#endif  // VLSERVE_PAIRS_AMX || VLSERVE_PAIRS_DPBF16
#endif  // VLSERVE_ATTENTION_PAIRS_H
