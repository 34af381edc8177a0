// WNA16 on AMX (bf16 tiles), included by quant_linear.cpp after quant_linear_avx2.cpp (its Call, dequantizers and
// output rows). For bf16 x of several rows on CPUs with AMX-BF16: each panel of 32 output columns is dequantized
// once per call exactly as D computes it in float32 (`IntW`: (q - z) * s), rounded to bf16 (nearest even), and laid
// out as the tile unit reads B (K pairs interleaved: a 32-bit lane holds w[k][n], w[k+1][n]); then every 32-row
// block of x is multiplied by it with tdpbf16ps, float32 sums. Elsewhere kAmx is 0 and Python never asks for it.
namespace quant {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512VL__) && \
    !defined(VLSERVE_FORCE_AVX2)
constexpr int64_t kAmx = 1;
constexpr int64_t kTileK = 32;  // K positions of one tile step (16 bf16 pairs); B tiles [16 pairs, 16 columns]

struct alignas(64) TileConfig {  // palette 1: every tile 16 rows of 64 bytes
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Linux hands a process the tile data state on request (oneDNN asks too; asking twice is harmless)
static bool amx_permitted() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ok;
}

// 16 group scales of consecutive columns (float32, float16 or bf16 as stored) as float32
static inline __m512 load_scales16(const void* base, int64_t at, int dtype) {
    if (dtype == 1) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)base + at)));
    if (dtype == 2)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)base + at))), 16));
    return _mm512_loadu_ps((const float*)base + at);
}

// buf [K32 / 32, 2, 16, 16] uint32: tile (kb, half) row r column n = bf16 pair (w[32 kb + 2r][16 half + n],
// w[32 kb + 2r + 1][..]) of a panel, each weight (q - z) * s in float32 (as IntW and the reference compute it)
// rounded to bf16 (nearest even); zero past Kp. 16 columns a zmm: two values' conversions in one vcvtne2ps2bf16,
// interleaved into pairs by one word permute.
template <int kBits>
static void dequant_panel_bf16(const Call& c, const uint32_t* lanes, int64_t group_base, int64_t Kp, int64_t K32,
                               uint32_t* buf) {
    constexpr int E = 32 / kBits;
    const int64_t per_group = c.group / E, lane_rows = Kp / E;
    alignas(64) int16_t order[32];
    for (int n = 0; n < 16; ++n) order[2 * n] = int16_t(n), order[2 * n + 1] = int16_t(16 + n);
    const __m512i pairs = _mm512_load_si512(order), mask = _mm512_set1_epi32((1 << kBits) - 1);
    if (K32 > Kp) std::memset(buf + (K32 - kTileK) / kTileK * 2 * 256, 0, 2 * 256 * sizeof(uint32_t));
    for (int64_t l = 0; l < lane_rows;) {
        const int64_t g = l / per_group, end = std::min(lane_rows, (g + 1) * per_group);
        __m512 s[2], z[2];
        for (int h = 0; h < 2; ++h) {
            const int64_t at = group_base + g * kPanel + 16 * h;
            s[h] = load_scales16(c.scales, at, c.scale_dtype);
            z[h] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)((const uint8_t*)c.zeros + at))));
        }
        for (; l < end; ++l) {
            UNROLL for (int h = 0; h < 2; ++h) {
                const __m512i q = _mm512_loadu_si512(lanes + l * kPanel + 16 * h);
                UNROLL for (int j = 0; j < E; j += 2) {
                    const __m512 lo = _mm512_mul_ps(
                        _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(q, kBits * j), mask)), z[h]),
                        s[h]);
                    const __m512 hi = _mm512_mul_ps(
                        _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(q, kBits * (j + 1)), mask)),
                                      z[h]),
                        s[h]);
                    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // words 0-15: lo, 16-31: hi
                    const int64_t k = l * E + j, kb = k / kTileK, r = (k % kTileK) / 2;
                    _mm512_storeu_si512(buf + ((kb * 2 + h) * 16 + r) * 16, _mm512_permutexvar_epi16(pairs, both));
                }
            }
        }
    }
}

// y = x W^T + b for bf16 x [M, K]: W dequantized by D a panel at a time, the products on the tile unit
template <int kBits>
static void amx_dequant_linear(const Call& c) {
    using D = IntW<kBits>;
    const int64_t Kp = (c.K + 7) / 8 * 8, K32 = (c.K + kTileK - 1) / kTileK * kTileK, Mp = (c.M + 15) / 16 * 16;
    const int64_t panels = (c.N + kPanel - 1) / kPanel, groups = (Kp + c.group - 1) / c.group;
    const int64_t panel_lanes = Kp / D::E * kPanel, steps = K32 / kTileK;
    const uint32_t* W = (const uint32_t*)c.w;
    // x as A tiles [Mp / 16, steps, 16 rows, 32 K], zero past M and K: each tile 1 KB in one piece, so a row
    // block's tiles are one sequential stream (16 rows K32 apart were 16 streams the prefetchers lost)
    static thread_local std::vector<bf16> xt;
    xt.assign(Mp * K32, bf16{});
    for (int64_t m = 0; m < c.M; ++m) {
        const bf16* row = (const bf16*)c.x + m * c.ldx;
        bf16* dst = xt.data() + (m / 16) * 16 * K32 + (m % 16) * kTileK;
        for (int64_t k0 = 0; k0 < c.K; k0 += kTileK)
            std::memcpy(dst + k0 * 16, row + k0, std::min(kTileK, c.K - k0) * sizeof(bf16));
    }
    const bf16* X = xt.data();
    constexpr int64_t stride = kTileK * sizeof(bf16);
#pragma omp parallel num_threads(c.threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        if (p0 < p1) {
            TileConfig cfg;
            for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
            _tile_loadconfig(&cfg);
            // panels dequantized together (~1 MB of bf16 tiles, in L2): every row block of x then runs over all of
            // them, so the output is written a few hundred bytes of a row at a time, not 64 bytes rows far apart
            const int64_t tile_words = steps * 2 * 256, together = std::clamp<int64_t>((1 << 18) / tile_words, 1, 16);
            static thread_local std::vector<uint32_t> buf;
            buf.resize(together * tile_words);
            alignas(64) float sums[32 * kPanel];
            for (int64_t pg = p0; pg < p1; pg += together) {
                const int64_t pn = std::min(together, p1 - pg);
                for (int64_t i = 0; i < pn; ++i)
                    dequant_panel_bf16<kBits>(c, W + (pg + i) * panel_lanes, (pg + i) * groups * kPanel, Kp, K32,
                                              buf.data() + i * tile_words);
                for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
                    const bool two = m0 + 16 < Mp;  // a second 16-row block
                    const bf16* a = X + m0 * K32;
                    for (int64_t i = 0; i < pn; ++i) {
                        const int64_t p = pg + i, ncols = std::min(kPanel, c.N - p * kPanel);
                        const uint32_t* bp = buf.data() + i * tile_words;
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                        for (int64_t s = 0; s < steps; ++s) {
                            const uint32_t* bt = bp + s * 2 * 256;
                            _tile_loadd(4, a + s * 16 * kTileK, stride);
                            _tile_loadd(6, bt, 64);
                            _tile_loadd(7, bt + 256, 64);
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_dpbf16ps(1, 4, 7);
                            if (two) {
                                _tile_loadd(5, a + 16 * K32 + s * 16 * kTileK, stride);
                                _tile_dpbf16ps(2, 5, 6);
                                _tile_dpbf16ps(3, 5, 7);
                            }
                        }
                        _tile_stored(0, sums, kPanel * 4);
                        _tile_stored(1, sums + 16, kPanel * 4);
                        _tile_stored(2, sums + 16 * kPanel, kPanel * 4);
                        _tile_stored(3, sums + 16 * kPanel + 16, kPanel * 4);
                        __m256 b[4];
                        panel_bias(c, p, ncols, b);
                        for (int64_t r = 0; r < std::min<int64_t>(32, c.M - m0); ++r) {
                            __m256 v[4];
                            UNROLL for (int j = 0; j < 4; ++j)
                                v[j] = _mm256_add_ps(_mm256_loadu_ps(sums + r * kPanel + 8 * j), b[j]);
                            store_row(c, m0 + r, p, ncols, v);
                        }
                    }
                }
            }
            _tile_release();
        }
    }
}

// Whether the AMX path can run this call: bf16 x, the tile state granted
static bool amx_serves(const Call& c) { return c.bf16 && amx_permitted(); }
#else
constexpr int64_t kAmx = 0;
static bool amx_serves(const Call&) { return false; }
template <int kBits>
static void amx_dequant_linear(const Call&) {}
#endif

}  // namespace quant
