// 4-bit WNA16 on AMX by table lookup, included by quant_linear.cpp after quant_linear_amx.cpp (its Call, scale
// loads, output rows and tile constants). A 4-bit weight of one column and group can take only 16 values, so each
// (column, group) gets a table of them, bf16((i - z) * s) for i = 0..15 computed in float32 as IntV computes every
// weight: a vpermw per 32 weights then turns the nibbles into those bf16 values (against ~13 instructions a
// dequantize-and-convert costs). The lookup works on one column at a time, 32 K positions in a zmm, which is a row
// of an A tile: here the matrix is A (its rows the output columns) and x^T is B, and the float32 sums [n, m] are
// transposed on the way out. Groups of 8 or 16 positions (a tile row would span two) take amx_dequant_linear.
namespace quant {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__) && \
    !defined(VLSERVE_FORCE_AVX2)
constexpr int64_t kAmxInt4 = 1;

// r[i] (16 lanes of 32 bits) -> r[j] lane i = r[i] lane j
static inline void transpose16(__m512i (&r)[16]) {
    __m512i t[16];
    UNROLL for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    UNROLL for (int i = 0; i < 4; ++i) {  // r[4i + j], 128-bit lane L: rows 4i..4i+3 of column 4L + j
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    UNROLL for (int j = 0; j < 4; ++j) {  // column 4L + j gathers lane L of r[j], r[4 + j], r[8 + j], r[12 + j]
        const __m512i a = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88), b = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);
        const __m512i c = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
        const __m512i d = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
        t[j] = _mm512_shuffle_i32x4(a, c, 0x88);
        t[8 + j] = _mm512_shuffle_i32x4(a, c, 0xdd);
        t[4 + j] = _mm512_shuffle_i32x4(b, d, 0x88);
        t[12 + j] = _mm512_shuffle_i32x4(b, d, 0xdd);
    }
    UNROLL for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// Column n's table: bf16((i - z) * s), i = 0..15, in words 0-15 and again in 16-31 (vpermw reads an index's low
// 5 bits; bit 4 is the neighbouring nibble's). s and z broadcast from memory: no shuffle-port work.
static inline __m512i lookup_table(const float* s, const float* z, int n) {
    const __m512 i = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 v = _mm512_mul_ps(_mm512_sub_ps(i, _mm512_set1_ps(z[n])), _mm512_set1_ps(s[n]));
    return (__m512i)_mm512_cvtne2ps_pbh(v, v);
}

// A tile rows hold a column's 32 K positions in this order: word 8c + w is position 4w + c (x^T is permuted to
// match). So a row is the column's 16 bytes broadcast to the four 128-bit lanes (a load, no shuffle), each word
// shifted right by 4c (its low nibble is then the weight; bit 4, the next nibble's, is ignored by the table).
static inline int64_t tile_position(int a) { return 4 * (a % 8) + a / 8; }

// A tiles of one panel's steps [s0, s1): tiles [s1 - s0, 2 halves] of [16 columns, 32 K positions] bf16 (1 KB
// each), K positions past the packed rows read as nibble 0 (x^T is zero there). Groups are a multiple of 32
// positions, or one. `next` (or null): lanes fetched into the cache meanwhile, 8 lines a step.
constexpr int64_t kColumnSteps = 8;  // steps whose columns are gathered before they are looked up
static void lookup_panel(const Call& c, const uint32_t* lanes, int64_t group_base, int64_t Kp, int64_t groups,
                         int64_t s0, int64_t s1, uint16_t* tiles, const uint32_t* next) {
    const int64_t lane_rows = Kp / 8;
    alignas(64) uint16_t by_lane[32];
    for (int a = 0; a < 32; ++a) by_lane[a] = uint16_t(4 * (a / 8));
    const __m512i shift = _mm512_load_si512(by_lane);
    // columns [kColumnSteps, 2 halves, 4 j, 4 L] of 16 bytes: column 4L + j of a half, its 32 nibbles in K order
    alignas(64) uint8_t columns[kColumnSteps * 2 * 256];
    for (int64_t c0 = s0; c0 < s1; c0 += kColumnSteps) {
        const int64_t c1 = std::min(s1, c0 + kColumnSteps);
        for (int64_t s = c0; s < c1; ++s) {
            if (next)
                for (int i = 0; i < 8; ++i) _mm_prefetch((const char*)(next + 4 * s * kPanel) + 64 * i, _MM_HINT_T0);
            UNROLL for (int h = 0; h < 2; ++h) {
                __m512i r[4];  // panel rows 4s..4s+3: 16 columns' 8 nibbles each
                UNROLL for (int i = 0; i < 4; ++i) {
                    const int64_t l = 4 * s + i;
                    r[i] = l < lane_rows ? _mm512_loadu_si512(lanes + l * kPanel + 16 * h) : _mm512_setzero_si512();
                }
                // u[j], 128-bit lane L: column 4L + j's 4 lanes
                const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]), t1 = _mm512_unpackhi_epi32(r[0], r[1]);
                const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]), t3 = _mm512_unpackhi_epi32(r[2], r[3]);
                uint8_t* at = columns + ((s - c0) * 2 + h) * 256;
                _mm512_store_si512(at, _mm512_unpacklo_epi64(t0, t2));
                _mm512_store_si512(at + 64, _mm512_unpackhi_epi64(t0, t2));
                _mm512_store_si512(at + 128, _mm512_unpacklo_epi64(t1, t3));
                _mm512_store_si512(at + 192, _mm512_unpackhi_epi64(t1, t3));
            }
        }
        for (int h = 0; h < 2; ++h) {
            __m512i table[16];
            int64_t current = -1;
            for (int64_t s = c0; s < c1; ++s) {
                const int64_t g = groups == 1 ? 0 : s * kTileK / c.group;
                if (g != current) {
                    const int64_t at = group_base + g * kPanel + 16 * h;
                    alignas(64) float s16[16], z16[16];
                    _mm512_store_ps(s16, load_scales16(c.scales, at, c.scale_dtype));
                    _mm512_store_ps(z16, _mm512_cvtepi32_ps(
                        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)((const uint8_t*)c.zeros + at)))));
                    UNROLL for (int n = 0; n < 16; ++n) table[n] = lookup_table(s16, z16, n);
                    current = g;
                }
                const uint8_t* col = columns + ((s - c0) * 2 + h) * 256;
                uint16_t* tile = tiles + ((s - s0) * 2 + h) * 512;
                UNROLL for (int j = 0; j < 4; ++j) UNROLL for (int L = 0; L < 4; ++L) {
                    const int n = 4 * L + j;
                    const __m128i own = _mm_load_si128((const __m128i*)(col + 64 * j + 16 * L));  // its 16 bytes
                    const __m512i nibbles = _mm512_srlv_epi16(_mm512_broadcast_i32x4(own), shift);
                    _mm512_store_si512(tile + n * 32, _mm512_permutexvar_epi16(nibbles, table[n]));
                }
            }
        }
    }
}

// x^T as B tiles [Mp / 16, steps] of [16 K pairs, 16 rows] (1 KB each; zero past M and K)
static void transpose_rows(const Call& c, int64_t steps, uint32_t* xt) {
    alignas(64) uint16_t positions[32];
    for (int a = 0; a < 32; ++a) positions[a] = uint16_t(tile_position(a));
    const __m512i order = _mm512_load_si512(positions);
    for (int64_t mb = 0; mb * 16 < c.M; ++mb)
        for (int64_t s = 0; s < steps; ++s) {
            const int64_t k0 = s * kTileK, n = std::min(kTileK, c.K - k0);
            const __mmask32 keep = n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1;
            __m512i r[16];
            UNROLL for (int i = 0; i < 16; ++i) {  // each row's 32 positions in the A tiles' order
                const int64_t m = mb * 16 + i;
                r[i] = m < c.M ? _mm512_permutexvar_epi16(order, _mm512_maskz_loadu_epi16(
                                                                     keep, (const bf16*)c.x + m * c.ldx + k0))
                               : _mm512_setzero_si512();
            }
            transpose16(r);
            uint32_t* tile = xt + (mb * steps + s) * 256;
            UNROLL for (int i = 0; i < 16; ++i) _mm512_store_si512(tile + 16 * i, r[i]);
        }
}

// Output rows m0.. (at most 32) of panel p from its sums [32 columns n, 32 rows m] (rows 128 bytes apart)
static void store_transposed(const Call& c, int64_t p, int64_t m0, const float* sums) {
    const int64_t ncols = std::min(kPanel, c.N - p * kPanel), rows = std::min<int64_t>(32, c.M - m0);
    float padded[kPanel] = {};
    if (c.bias) std::copy(c.bias + p * kPanel, c.bias + p * kPanel + ncols, padded);
    const __m512 bias[2] = {_mm512_loadu_ps(padded), _mm512_loadu_ps(padded + 16)};
    const __mmask16 lo = ncols >= 16 ? 0xffff : __mmask16((1u << ncols) - 1);
    const __mmask16 hi = ncols >= 32 ? 0xffff : ncols <= 16 ? 0 : __mmask16((1u << (ncols - 16)) - 1);
    for (int64_t mh = 0; mh * 16 < rows; ++mh) {
        __m512i t[2][16];  // t[nh][j]: row m0 + 16 mh + j, columns 16 nh ..
        UNROLL for (int nh = 0; nh < 2; ++nh) {
            UNROLL for (int i = 0; i < 16; ++i)
                t[nh][i] = _mm512_castps_si512(_mm512_loadu_ps(sums + (16 * nh + i) * kPanel + 16 * mh));
            transpose16(t[nh]);
        }
        for (int64_t j = 0; j < std::min<int64_t>(16, rows - 16 * mh); ++j) {
            bf16* dst = (bf16*)c.out + (m0 + 16 * mh + j) * c.ldo + p * kPanel;
            UNROLL for (int nh = 0; nh < 2; ++nh) {
                const __m512 v = _mm512_add_ps(_mm512_castsi512_ps(t[nh][j]), bias[nh]);
                _mm256_mask_storeu_epi16(dst + 16 * nh, nh ? hi : lo, (__m256i)_mm512_cvtneps_pbh(v));
            }
        }
    }
}

// One panel's sums [32 columns, 32 rows] (rows 16-31 only where `two`) for a single block of rows: kChunkSteps steps
// looked up into `tiles` (16 KB) at a time and multiplied at once, the sums kept in tiles 0-3 throughout
constexpr int64_t kChunkSteps = 8;
static void one_block_panel(const Call& c, const uint32_t* lanes, int64_t group_base, int64_t Kp, int64_t groups,
                            int64_t steps, const uint32_t* xt, bool two, uint16_t* tiles, const uint32_t* next,
                            float* sums) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const char* b = (const char*)xt;
    for (int64_t s0 = 0; s0 < steps; s0 += kChunkSteps) {
        const int64_t s1 = std::min(steps, s0 + kChunkSteps);
        lookup_panel(c, lanes, group_base, Kp, groups, s0, s1, tiles, next);
        for (int64_t s = s0; s < s1; ++s) {
            const char* a = (const char*)(tiles + (s - s0) * 1024);
            _tile_loadd(4, a, 64);
            _tile_loadd(5, a + 1024, 64);
            _tile_loadd(6, b + s * 1024, 64);
            amx_tiles::Bf16Dot::lo0();
            amx_tiles::Bf16Dot::lo1();
            if (two) {
                _tile_loadd(7, b + (steps + s) * 1024, 64);
                amx_tiles::Bf16Dot::hi0();
                amx_tiles::Bf16Dot::hi1();
            }
        }
    }
    char* out = (char*)sums;
    _tile_stored(0, out, 128);
    _tile_stored(2, out + 16 * 128, 128);
    if (two) {
        _tile_stored(1, out + 64, 128);
        _tile_stored(3, out + 16 * 128 + 64, 128);
    }
}

// y = x W^T + b for bf16 x [M, K] and 4-bit W: each panel's A tiles looked up once per call, then every 32-row
// block of x^T multiplied by them
static void amx_lookup_linear(const Call& c) {
    const int64_t Kp = (c.K + 7) / 8 * 8, steps = (c.K + kTileK - 1) / kTileK, Mp = (c.M + 15) / 16 * 16;
    const int64_t panels = (c.N + kPanel - 1) / kPanel, groups = (Kp + c.group - 1) / c.group;
    const int64_t panel_lanes = Kp / 8 * kPanel;
    const uint32_t* W = (const uint32_t*)c.w;
    static thread_local std::vector<uint32_t> xt_buf;
    xt_buf.resize(Mp / 16 * steps * 256 + 16);
    uint32_t* xt = (uint32_t*)(((uintptr_t)xt_buf.data() + 63) & ~uintptr_t(63));
    transpose_rows(c, steps, xt);
#pragma omp parallel num_threads(c.threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        if (p0 < p1) {
            amx_tiles::configure();
            // one block of rows: a few steps looked up at a time, then multiplied while in L1; more: panels looked
            // up together (~1 MB of tiles, in L2), then every block of rows multiplied by them
            const int64_t tile_words = steps * 2 * 512, together = std::clamp<int64_t>((1 << 19) / tile_words, 1, 16);
            const bool one_block = Mp <= 32;
            static thread_local std::vector<uint16_t> buf;
            buf.resize((one_block ? std::min(steps, kChunkSteps) * 1024 : together * tile_words) + 32);
            uint16_t* tiles = (uint16_t*)(((uintptr_t)buf.data() + 63) & ~uintptr_t(63));
            alignas(64) float sums[32 * kPanel];
            if (one_block) {
                for (int64_t p = p0; p < p1; ++p) {
                    const uint32_t* next = p + 1 < p1 ? W + (p + 1) * panel_lanes : nullptr;
                    one_block_panel(c, W + p * panel_lanes, p * groups * kPanel, Kp, groups, steps, xt, Mp > 16,
                                    tiles, next, sums);
                    store_transposed(c, p, 0, sums);
                }
            } else {
                for (int64_t pg = p0; pg < p1; pg += together) {
                    const int64_t pn = std::min(together, p1 - pg);
                    for (int64_t i = 0; i < pn; ++i)
                        lookup_panel(c, W + (pg + i) * panel_lanes, (pg + i) * groups * kPanel, Kp, groups, 0,
                                     steps, tiles + i * tile_words, nullptr);
                    for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
                        const uint32_t* b = xt + m0 / 16 * steps * 256;
                        for (int64_t i = 0; i < pn; ++i) {
                            // A: step s's two column halves 1 KB apart, 2 KB a step; B: step s of the 16-row block
                            // at 1 KB a step, the next 16 rows' block steps KB further
                            amx_tiles::panel_sums<amx_tiles::Bf16Dot>(tiles + i * tile_words, 2048, 1024, b, 1024,
                                                                      steps * 1024, 64, steps, true, sums,
                                                                      m0 + 16 < Mp);
                            store_transposed(c, pg + i, m0, sums);
                        }
                    }
                }
            }
            _tile_release();
        }
    }
}

// Whether the lookup path serves this 4-bit call (amx_serves already true): groups of whole tile steps, or one
static bool lookup_serves(const Call& c) {
    const int64_t Kp = (c.K + 7) / 8 * 8;
    return c.group >= Kp || c.group % kTileK == 0;
}
#else
constexpr int64_t kAmxInt4 = 0;
static void amx_lookup_linear(const Call&) {}
static bool lookup_serves(const Call&) { return false; }
#endif

}  // namespace quant
