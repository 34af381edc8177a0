// Attention of short segments (causal or bidirectional): see vlserve/kernels/varlen_attention_cpu.py.
// One OpenMP task per (segment, KV head): its keys (rows of k, or positions of a paged cache) are widened to float32
// and transposed into Kt [D][L] and its values into Vf [L][D], then each query head of its group takes its rows four
// at a time: the rows' scores over the keys
// they see (vectors along the keys, the four rows sharing each Kt load), a float32 softmax, then the weighted sum of
// values (up to four vectors along D a pass, the four rows sharing each value load and each row's weight broadcast
// shared by those vectors). Nothing is read past a segment's end, and a
// row's result depends only on its query and the keys it sees (not on the rows it shares a block with).
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#include "vec_bf16.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kRows = 4;  // query rows that share each key / value load

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

inline void store_row(const float* src, int64_t D, bool bf16, void* out, int64_t offset) {
    if (bf16) {
        auto* o = static_cast<c10::BFloat16*>(out) + offset;
        int64_t d = 0;
        for (; d + Vec::size() <= D; d += Vec::size()) vec_bf16::store_bf16(o + d, Vec::loadu(src + d));
        for (; d < D; ++d) o[d] = c10::BFloat16(src[d]);
    } else {
        float* o = static_cast<float*>(out) + offset;
        std::copy(src, src + D, o);
    }
}

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

// scores[0..n) -> softmax weights in place, and zero in [n, whole vectors): s has room for them
inline void softmax_row(float* s, int64_t n) {
    const int64_t nv = whole_vectors(n);
    std::fill(s + n, s + nv, -std::numeric_limits<float>::infinity());
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

// acc[r][0..D) = sum_j p[r][j] * Vf[j][0..D) over j < n for the kRows rows (p [kRows][sld], zero where a row sees
// no key); Vf [L][D]. Four value vectors a pass where the ISA has 32 vector registers (AVX-512), two otherwise; each
// element's sum runs over j in order, whatever the blocking.
void weighted_values(const float* p, int64_t sld, int64_t n, const float* vf, int64_t D, float* acc) {
    constexpr int64_t W = Vec::size();
    constexpr int NV = W >= 16 ? 4 : 2;
    int64_t d = 0;
    for (; d + NV * W <= D; d += NV * W) weighted_values_block<NV>(p, sld, n, vf, D, d, acc);
    for (; d + W <= D; d += W) weighted_values_block<1>(p, sld, n, vf, D, d, acc);
    for (; d < D; ++d)
        for (int64_t r = 0; r < kRows; ++r) {
            float s = 0.0f;
            for (int64_t j = 0; j < n; ++j) s += p[r * sld + j] * vf[j * D + d];
            acc[r * D + d] = s;
        }
}

}  // namespace

// bf16 on AMX tiles (where the source is built with AMX-BF16 and D is a multiple of 32): one task's keys packed as
// the B tiles of Q.K^T, its values as the B tiles of P.V (bf16 pairs, zero past the keys), the query rows of a head
// copied into 32-row blocks; float32 scores in tiles, the same float32 softmax, the weights rounded to bf16 (as
// torch's CPU flash attention rounds them for bf16) and multiplied with the values on tiles, float32 sums. A row's
// result still depends only on its query and the keys it sees: padding keys and unseen ones weigh exactly 0.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_tiles.h"
#define VLSERVE_ATTENTION_AMX 1
namespace attention_amx {

constexpr int64_t kBlock = 32;  // query rows of a block (two A tiles), keys of a score panel / of a P.V step

struct Task {
    std::vector<uint32_t> kb, vb;  // B tiles: [key block of 16][D / 32 steps] and [key step of 32][D / 16 columns]
    std::vector<uint16_t> qb, pb;  // query rows [Qp][D] and weights [Qp][Lp], bf16 bits, zero past the segment
    std::vector<float> scores, acc;  // [Qp][Lp] and [32][D]
};

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

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
    const int64_t nv = whole_vectors(n);
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

// One (segment, KV head) task: keys / values row j at key_row(j) of k / v (bf16, head h at h * D), query heads hq0
// .. hq0 + group of rows q_start .. q_start + Q.
template <typename KeyRow>
void run(Task& t, const uint16_t* q, const uint16_t* k, const uint16_t* v, c10::BFloat16* out, int64_t q_ld,
         int64_t k_ld, int64_t v_ld, int64_t o_ld, int64_t q_start, int64_t Q, int64_t L, int64_t h, int64_t hq0,
         int64_t group, int64_t D, float scale, bool causal, KeyRow key_row) {
    const int64_t Qp = round_up(Q, kBlock), Lp = round_up(L, kBlock), DS = D / 32, DC = D / 16, first = L - Q;
    t.kb.resize(Lp * D / 2);
    t.vb.resize(Lp * D / 2);
    const int64_t last = (L - 1) / kBlock * kBlock;  // the last value step: zero, then its values written over
    std::fill(t.vb.begin() + last * D / 2, t.vb.end(), 0u);
    for (int64_t j0 = 0; j0 < Lp; j0 += 16) {  // keys: tile (j / 16, step p / 16), row p % 16 (pair p), column j % 16
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
    for (int64_t j = 0; j < L; j += 2) {  // values: tile (step j / 32, columns d / 16), row (j % 32) / 2: pairs
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
    t.qb.resize(Qp * D);
    t.pb.resize(Qp * Lp);
    t.scores.resize(Qp * Lp);
    t.acc.resize(kBlock * D);
    std::fill(t.qb.begin() + Q * D, t.qb.end(), uint16_t(0));
    std::fill(t.pb.begin() + Q * Lp, t.pb.end(), uint16_t(0));
    for (int64_t hq = hq0; hq < hq0 + group; ++hq) {
        for (int64_t i = 0; i < Q; ++i) {
            const uint16_t* row = q + (q_start + i) * q_ld + hq * D;
            std::copy(row, row + D, t.qb.data() + i * D);
        }
        for (int64_t i0 = 0; i0 < Q; i0 += kBlock) {
            const int64_t rows = std::min(kBlock, Q - i0), n_max = causal ? first + i0 + rows : L;
            float* s = t.scores.data() + i0 * Lp;
            for (int64_t j0 = 0; j0 < n_max; j0 += kBlock) {  // scores of 32 rows x 32 keys
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t ds = 0; ds < DS; ++ds) {
                    _tile_loadd(4, t.qb.data() + i0 * D + ds * 32, D * 2);
                    _tile_loadd(5, t.qb.data() + (i0 + 16) * D + ds * 32, D * 2);
                    _tile_loadd(6, t.kb.data() + ((j0 / 16) * DS + ds) * 256, 64);
                    _tile_loadd(7, t.kb.data() + ((j0 / 16 + 1) * DS + ds) * 256, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, s + j0, Lp * 4);
                _tile_stored(1, s + j0 + 16, Lp * 4);
                _tile_stored(2, s + 16 * Lp + j0, Lp * 4);
                _tile_stored(3, s + 16 * Lp + j0 + 16, Lp * 4);
            }
            for (int64_t r = 0; r < rows; ++r)  // the weights in bf16, zero past the row's keys
                softmax_bf16(s + r * Lp, causal ? first + i0 + r + 1 : L, Lp, scale, t.pb.data() + (i0 + r) * Lp);
            for (int64_t d0 = 0; d0 < D; d0 += 32) {  // the weighted values: 32 rows x 32 of D
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t j0 = 0; j0 < n_max; j0 += kBlock) {
                    _tile_loadd(4, t.pb.data() + i0 * Lp + j0, Lp * 2);
                    _tile_loadd(5, t.pb.data() + (i0 + 16) * Lp + j0, Lp * 2);
                    _tile_loadd(6, t.vb.data() + ((j0 / kBlock) * DC + d0 / 16) * 256, 64);
                    _tile_loadd(7, t.vb.data() + ((j0 / kBlock) * DC + d0 / 16 + 1) * 256, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, t.acc.data() + d0, D * 4);
                _tile_stored(1, t.acc.data() + d0 + 16, D * 4);
                _tile_stored(2, t.acc.data() + 16 * D + d0, D * 4);
                _tile_stored(3, t.acc.data() + 16 * D + d0 + 16, D * 4);
            }
            for (int64_t r = 0; r < rows; ++r)
                store_row(t.acc.data() + r * D, D, true, out, (q_start + i0 + r) * o_ld + hq * D);
        }
    }
}

}  // namespace attention_amx
#endif

// q / out [*, Hq, D], k / v [*, Hkv, D]: row strides q_ld / k_ld / v_ld / o_ld elements, head stride D, elements
// contiguous. Segment s: query rows q_starts[s] .. + q_lens[s] of q and out, over kv_lens[s] keys and values: the rows
// kv_starts[s] .. of k / v, or (tables given: k / v are the paged caches [NB, BS, Hkv, D], k_ld = v_ld = Hkv * D)
// positions 0 .. kv_lens[s] - 1 through the block ids tables[kv_starts[s] * M ..]. Query i sits at position
// kv_lens[s] - q_lens[s] + i; causal, it sees keys 0 .. that position, else all of them.
extern "C" void kernel(const void* q, const void* k, const void* v, void* out, int64_t q_ld, int64_t k_ld,
                       int64_t v_ld, int64_t o_ld, const int64_t* q_starts, const int64_t* q_lens,
                       const int64_t* kv_starts, const int64_t* kv_lens, const int32_t* tables, int64_t M,
                       int64_t BS, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, float scale, int64_t causal,
                       int64_t is_bf16, int64_t threads) {
    const bool bf16 = is_bf16 != 0;
    const int64_t group = Hq / Hkv;
    const int64_t tasks = S * Hkv;
#if defined(VLSERVE_ATTENTION_AMX)
    const bool amx = amx_tiles::permitted();
#else
    const bool amx = false;
#endif
    if (S < 0) {  // the probe: whether bf16 with D a multiple of 32 runs on AMX tiles here, written to out (int64)
        *static_cast<int64_t*>(out) = amx;
        return;
    }
    const bool tiles = amx && bf16 && D % 32 == 0;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> kt, vf, key, qs(kRows * D), scores, acc(kRows * D);
#if defined(VLSERVE_ATTENTION_AMX)
        attention_amx::Task amx_task;
        if (tiles) amx_tiles::configure();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; ++t) {
            const int64_t s = t / Hkv, h = t % Hkv, q_start = q_starts[s], Q = q_lens[s], L = kv_lens[s];
            if (Q <= 0 || L <= 0) continue;
#if defined(VLSERVE_ATTENTION_AMX)
            if (tiles) {
                const int32_t* table = tables ? tables + kv_starts[s] * M : nullptr;
                const int64_t kv0 = kv_starts[s];
                attention_amx::run(amx_task, static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k),
                                   static_cast<const uint16_t*>(v), static_cast<c10::BFloat16*>(out), q_ld, k_ld,
                                   v_ld, o_ld, q_start, Q, L, h, h * group, group, D, scale, causal != 0,
                                   [=](int64_t j) { return table ? int64_t(table[j / BS]) * BS + j % BS : kv0 + j; });
                continue;
            }
#endif
            const int64_t first = L - Q;  // position of the segment's first query
            const int64_t ld = (L + 2 * Vec::size() - 1) / (2 * Vec::size()) * (2 * Vec::size());  // Kt row length
            kt.assign(D * ld, 0.0f);
            vf.resize(L * D);
            key.resize(D);
            scores.resize(kRows * ld);
            const int32_t* table = tables ? tables + kv_starts[s] * M : nullptr;
            for (int64_t j = 0; j < L; ++j) {
                const int64_t row = table ? int64_t(table[j / BS]) * BS + j % BS : kv_starts[s] + j;
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
                    for (int64_t r = 0; r < kRows; ++r) {
                        const int64_t n = r < rows ? (causal ? first + i0 + r + 1 : L) : 0;
                        float* row = scores.data() + r * ld;
                        if (n > 0) softmax_row(row, n);  // zero up to whole vectors past n
                        const int64_t done = n > 0 ? whole_vectors(n) : 0;
                        if (done < n_max) std::fill(row + done, row + n_max, 0.0f);  // unseen keys weigh 0
                    }
                    weighted_values(scores.data(), ld, n_max, vf.data(), D, acc.data());
                    for (int64_t r = 0; r < rows; ++r)
                        store_row(acc.data() + r * D, D, bf16, out, (q_start + i0 + r) * o_ld + hq * D);
                }
            }
        }
#if defined(VLSERVE_ATTENTION_AMX)
        if (tiles) _tile_release();
#endif
    }
}
