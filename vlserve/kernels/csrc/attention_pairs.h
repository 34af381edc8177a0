// Segment attention of bf16 heads on bf16 pair products, for varlen_attention_cpu.cpp. A head's D elements are
// zero-padded to Dp (a multiple of 32). One task's keys are packed as the B operand of Q.K^T and its values as the B
// operand of P.V (AMX's B-tile layout: a row per pair of the reduced dimension, 16 columns of bf16 pairs, zero past
// the keys); a head's query rows are copied into 32-row blocks, which run over the keys a panel at a time (flash
// attention: float32 scores, a running max and sum per row, the weights rounded to bf16 unnormalized as torch's CPU
// flash attention rounds them, float32 sums of weights times values, divided by the row's sum at the end). Two
// engines run the products: AMX tiles, and AVX512-BF16's vdpbf16ps on the same packed rows. A row's result depends
// only on its query and the keys it sees: padding keys and unseen ones weigh exactly 0, and each engine sums a row in
// the same order whatever rows share its block.
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
#include "vec_exp2.h"

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
    std::vector<uint32_t> kb, vb;  // B operands: [key block of 16][Dp / 32 steps][16 pairs][16] and
                                   // [key step of 32][Dp / 16 column blocks][16 pairs][16]
    std::vector<uint16_t> qb, pb;  // query rows [Qp][Dp] (zero past the segment and D), a panel's weights [32][kPanel]
    std::vector<float> scores, acc;  // a panel's scores [32][kPanel], the block's sums [32][Dp] and a panel's
};

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// the first min(max(n, 0), 32) lanes
inline __mmask32 lanes32(int64_t n) { return n >= 32 ? ~__mmask32(0) : n <= 0 ? 0 : (__mmask32(1) << n) - 1; }

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

// One key panel's weights of a row, flash style: s[0..n) are its raw scores (n >= 1; s has room for whole vectors
// past n, whose tail is overwritten). m: the row's running max of the scaled scores in log2 units (-inf before its
// first panel), l: its running sum of weights. p[0..np) = 2^(log2(e) * scale * s - m') rounded to bf16, 0 past n
// (torch's CPU flash attention rounds its unnormalized weights to bf16 alike); returns 2^(m - m'), the factor on what
// the row summed before, and updates m <- m', l <- l * that + the panel's float32 sum.
inline float panel_weights(float* s, int64_t n, int64_t np, float scale, float& m, float& l, uint16_t* p) {
    constexpr int64_t W = 16;
    const int64_t nv = (n + W - 1) / W * W;
    std::fill(s + n, s + nv, -std::numeric_limits<float>::infinity());
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < nv; j += W) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
    const float log2_scale = scale * 1.44269504f;  // scale * log2(e)
    const float m_new = std::max(m, _mm512_reduce_max_ps(vmax) * log2_scale);
    const float rescale = m == m_new ? 1.0f : std::exp2(m - m_new);
    const __m512 vscale = _mm512_set1_ps(log2_scale), shift = _mm512_set1_ps(m_new);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < nv; j += W) {
        const __m512 e = vec_exp2::exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), vscale, shift));
        vsum = _mm512_add_ps(vsum, e);
        vec_bf16::store_bf16((c10::BFloat16*)(p + j), Vec(e));
    }
    std::fill(p + nv, p + np, uint16_t(0));
    m = m_new;
    l = l * rescale + _mm512_reduce_add_ps(vsum);
    return rescale;
}

// The task's keys and values (row j at key_row(j) of k / v, head h at h * D) into t.kb / t.vb, their D elements
// zero-padded to Dp (a multiple of 32)
template <typename KeyRow>
void pack_keys_values(Task& t, const uint16_t* k, const uint16_t* v, int64_t k_ld, int64_t v_ld, int64_t L,
                      int64_t h, int64_t D, int64_t Dp, KeyRow key_row) {
    const int64_t Lp = round_up(L, kBlock), DS = Dp / 32, DC = Dp / 16;
    t.kb.resize(Lp * Dp / 2);
    t.vb.resize(Lp * Dp / 2);
    const int64_t last = (L - 1) / kBlock * kBlock;  // the last value step: zero, then its values written over
    std::fill(t.vb.begin() + last * Dp / 2, t.vb.end(), 0u);
    for (int64_t j0 = 0; j0 < Lp; j0 += 16) {  // keys: block (j / 16, step p / 16), row p % 16 (pair p), column j % 16
        const uint16_t* rows[16];
        for (int64_t c = 0; c < 16; ++c) rows[c] = j0 + c < L ? k + key_row(j0 + c) * k_ld + h * D : nullptr;
        for (int64_t ds = 0; ds < DS; ++ds) {
            const __mmask32 inside = lanes32(D - ds * 32);
            __m512i block[16];  // key c's pairs 16 ds .. 16 ds + 15 (zero past the keys and past D), transposed
            for (int64_t c = 0; c < 16; ++c)
                block[c] = rows[c] ? _mm512_maskz_loadu_epi16(inside, rows[c] + ds * 32) : _mm512_setzero_si512();
            transpose16(block);
            uint32_t* tile = t.kb.data() + ((j0 / 16) * DS + ds) * 256;
            for (int64_t r = 0; r < 16; ++r) _mm512_storeu_si512(tile + r * 16, block[r]);
        }
    }
    for (int64_t j = 0; j < L; j += 2) {  // values: block (step j / 32, columns d / 16), row (j % 32) / 2: pairs
        const uint16_t* v0 = v + key_row(j) * v_ld + h * D;  // (value j, value j + 1) of each d
        const uint16_t* v1 = j + 1 < L ? v + key_row(j + 1) * v_ld + h * D : nullptr;
        uint32_t* vt = t.vb.data() + (j / kBlock) * DC * 256 + ((j % kBlock) / 2) * 16;
        for (int64_t d = 0; d < Dp; d += 16) {
            const __mmask16 inside = static_cast<__mmask16>(lanes32(D - d));
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(inside, v0 + d));
            const __m512i hi = v1 ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(inside, v1 + d))
                                  : _mm512_setzero_si512();
            _mm512_storeu_si512(vt + (d / 16) * 256, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

// Keys of a panel: a query block's scores and weights over them stay in L1 ([32][kPanel] float32 and bf16)
constexpr int64_t kPanel = 128;

// One (segment, KV head) task: keys / values row j at key_row(j) of k / v (bf16, head h at h * D), query heads hq0
// .. hq0 + group of rows q_start .. q_start + Q; query i at position L - Q + i (causal: it sees keys 0 .. that).
// Each 32-row query block runs over the keys panel by panel with a running max and sum per row (flash attention);
// a row's panels start at key 0 whatever rows share its block, so its result does not depend on them.
template <typename Engine, typename KeyRow>
void run(Task& t, const uint16_t* q, const uint16_t* k, const uint16_t* v, c10::BFloat16* out, int64_t q_ld,
         int64_t k_ld, int64_t v_ld, int64_t o_ld, int64_t q_start, int64_t Q, int64_t L, int64_t h, int64_t hq0,
         int64_t group, int64_t D, float scale, bool causal, KeyRow key_row) {
    const int64_t Qp = round_up(Q, kBlock), Dp = round_up(D, 32), DS = Dp / 32, DC = Dp / 16, first = L - Q;
    pack_keys_values(t, k, v, k_ld, v_ld, L, h, D, Dp, key_row);
    t.qb.resize(Qp * Dp);
    t.pb.resize(kBlock * kPanel);
    t.scores.resize(kBlock * kPanel);
    t.acc.resize(2 * kBlock * Dp);  // the block's sums [32][Dp], then one panel's [32][Dp]
    float* acc = t.acc.data();
    float* panel_sums = acc + kBlock * Dp;
    float row_max[kBlock], row_sum[kBlock];
    std::fill(t.qb.begin(), t.qb.end(), uint16_t(0));  // (columns past D stay zero)
    for (int64_t hq = hq0; hq < hq0 + group; ++hq) {
        for (int64_t i = 0; i < Q; ++i) {
            const uint16_t* row = q + (q_start + i) * q_ld + hq * D;
            std::copy(row, row + D, t.qb.data() + i * Dp);
        }
        for (int64_t i0 = 0; i0 < Q; i0 += kBlock) {
            const int64_t rows = std::min(kBlock, Q - i0), n_max = causal ? first + i0 + rows : L;
            std::fill(row_max, row_max + kBlock, -std::numeric_limits<float>::infinity());
            std::fill(row_sum, row_sum + kBlock, 0.0f);
            std::fill(t.pb.begin() + rows * kPanel, t.pb.end(), uint16_t(0));  // rows past the segment: never stored
            for (int64_t c0 = 0; c0 < n_max; c0 += kPanel) {
                const int64_t width = std::min(kPanel, n_max - c0), np = round_up(width, kBlock);
                float* s = t.scores.data();
                for (int64_t j = 0; j < width; j += kBlock)  // scores of 32 rows x 32 keys
                    Engine::block(t.qb.data() + i0 * Dp, Dp, t.kb.data() + ((c0 + j) / 16) * DS * 256, 256, DS * 256,
                                  DS, s + j, kPanel);
                for (int64_t r = 0; r < rows; ++r) {  // the weights in bf16, zero past the row's keys
                    const int64_t seen = (causal ? std::min(n_max, first + i0 + r + 1) : L) - c0;
                    uint16_t* p = t.pb.data() + r * kPanel;
                    if (seen <= 0) {  // (causal) no key of this panel: nothing changes
                        std::fill(p, p + np, uint16_t(0));
                        continue;
                    }
                    const float rescale = panel_weights(s + r * kPanel, std::min(seen, width), np, scale,
                                                        row_max[r], row_sum[r], p);
                    if (c0 > 0 && rescale != 1.0f) {
                        const Vec f(rescale);
                        for (int64_t d = 0; d < Dp; d += Vec::size())
                            (Vec::loadu(acc + r * Dp + d) * f).store(acc + r * Dp + d);
                    }
                }
                float* sums = c0 == 0 ? acc : panel_sums;
                for (int64_t d0 = 0; d0 < Dp; d0 += 32)  // the weighted values: 32 rows x 32 of Dp
                    Engine::block(t.pb.data(), kPanel, t.vb.data() + (c0 / kBlock) * DC * 256 + (d0 / 16) * 256,
                                  DC * 256, 256, np / kBlock, sums + d0, Dp);
                if (c0 > 0)
                    for (int64_t r = 0; r < rows; ++r)
                        for (int64_t d = 0; d < Dp; d += Vec::size())
                            (Vec::loadu(acc + r * Dp + d) + Vec::loadu(panel_sums + r * Dp + d)).store(acc + r * Dp + d);
            }
            for (int64_t r = 0; r < rows; ++r) {
                c10::BFloat16* o = out + (q_start + i0 + r) * o_ld + hq * D;
                const Vec inv(1.0f / row_sum[r]);
                int64_t d = 0;
                for (; d + Vec::size() <= D; d += Vec::size())
                    vec_bf16::store_bf16(o + d, Vec::loadu(acc + r * Dp + d) * inv);
                if (d < D) {  // a last part vector (D a multiple of 8, not of 16)
                    alignas(32) c10::BFloat16 tail[16];
                    vec_bf16::store_bf16(tail, Vec::loadu(acc + r * Dp + d) * inv);
                    _mm256_mask_storeu_epi16(o + d, static_cast<__mmask16>(lanes32(D - d)),
                                             _mm256_load_si256(reinterpret_cast<const __m256i*>(tail)));
                }
            }
        }
    }
}

}  // namespace attention_pairs
#endif  // VLSERVE_PAIRS_AMX || VLSERVE_PAIRS_DPBF16
#endif  // VLSERVE_ATTENTION_PAIRS_H
