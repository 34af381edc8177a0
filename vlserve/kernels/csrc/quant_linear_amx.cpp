// WNA16 and FP8 on AMX (bf16 tiles), included by quant_linear.cpp after quant_linear_avx2.cpp (its Call,
// dequantizers, e4m3 rounding and output rows). For bf16 x of several rows on CPUs with AMX-BF16: each panel of 32
// output columns is dequantized once per call to bf16 and laid out as the tile unit reads B (K pairs interleaved: a
// 32-bit lane holds w[k][n], w[k+1][n]); then every 32-row block of x is multiplied by it with tdpbf16ps, float32
// sums. WNA16 (`IntV`): each weight (q - z) * s computed in float32 as IntW does, rounded to bf16 (nearest even).
// FP8 with one scale per column and per-token or static activations (`Fp8V`): the e4m3 values themselves (exact in
// bf16) times x rounded through e4m3 as fake_quant_row rounds it (exact in bf16 too), the row and column scales
// applied to the sums. Elsewhere kAmx is 0 and Python never asks for it.
namespace quant {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512VL__) && \
    !defined(VLSERVE_FORCE_AVX2)
constexpr int64_t kAmx = 1;
constexpr int64_t kTileK = 32;  // K positions of one tile step (16 bf16 pairs); B tiles [16 pairs, 16 columns]
static inline bool amx_permitted() { return amx_tiles::permitted(); }

// 16 group scales of consecutive columns (float32, float16 or bf16 as stored) as float32
static inline __m512 load_scales16(const void* base, int64_t at, int dtype) {
    if (dtype == 1) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)base + at)));
    if (dtype == 2)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)base + at))), 16));
    return _mm512_loadu_ps((const float*)base + at);
}

// Integer weights: (q - z) * s per group, in float32 as IntW computes them
template <int kBits>
struct IntV {
    static constexpr int E = 32 / kBits;
    const __m512i mask = _mm512_set1_epi32((1 << kBits) - 1);
    __m512 s[2], z[2];
    void group(const Call& c, int64_t at) {  // the group's 32 columns' scales and zeros
        for (int h = 0; h < 2; ++h) {
            s[h] = load_scales16(c.scales, at + 16 * h, c.scale_dtype);
            z[h] = _mm512_cvtepi32_ps(
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)((const uint8_t*)c.zeros + at + 16 * h))));
        }
    }
    __m512 value(__m512i q, int j, int h) const {
        return _mm512_mul_ps(
            _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(q, kBits * j), mask)), z[h]), s[h]);
    }
};

// e4m3 weights as their own values (the column scales go to the sums): byte j moved to the top of the lane,
// shifted right 4 (arithmetic) and masked is a float32 of the value times 2^-120 (as Fp8W::value), times 2^120
struct Fp8V {
    static constexpr int E = 4;
    void group(const Call&, int64_t) {}
    __m512 value(__m512i q, int j, int) const {
        const __m512i top = j == 3 ? q : _mm512_slli_epi32(q, 24 - 8 * j);
        const __m512i bits = _mm512_and_si512(_mm512_srai_epi32(top, 4), _mm512_set1_epi32(int32_t(0x87f00000u)));
        return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
    }
};

// buf [K32 / 32, 2, 16, 16] uint32: tile (kb, half) row r column n = bf16 pair (w[32 kb + 2r][16 half + n],
// w[32 kb + 2r + 1][..]) of a panel, each weight V's float32 value rounded to bf16 (nearest even); zero past Kp.
// 16 columns a zmm: two values' conversions in one vcvtne2ps2bf16, interleaved into pairs by one word permute.
template <typename V>
static void dequant_panel_bf16(const Call& c, const uint32_t* lanes, int64_t group_base, int64_t Kp, int64_t K32,
                               uint32_t* buf) {
    const int64_t per_group = c.group / V::E, lane_rows = Kp / V::E;
    alignas(64) int16_t order[32];
    for (int n = 0; n < 16; ++n) order[2 * n] = int16_t(n), order[2 * n + 1] = int16_t(16 + n);
    const __m512i pairs = _mm512_load_si512(order);
    V v;
    if (K32 > Kp) std::memset(buf + (K32 - kTileK) / kTileK * 2 * 256, 0, 2 * 256 * sizeof(uint32_t));
    for (int64_t l = 0; l < lane_rows;) {
        const int64_t g = l / per_group, end = std::min(lane_rows, (g + 1) * per_group);
        v.group(c, group_base + g * kPanel);
        for (; l < end; ++l) {
            UNROLL for (int h = 0; h < 2; ++h) {
                const __m512i q = _mm512_loadu_si512(lanes + l * kPanel + 16 * h);
                UNROLL for (int j = 0; j < V::E; j += 2) {
                    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(v.value(q, j + 1, h), v.value(q, j, h));
                    const int64_t k = l * V::E + j, kb = k / kTileK, r = (k % kTileK) / 2;
                    _mm512_storeu_si512(buf + ((kb * 2 + h) * 16 + r) * 16, _mm512_permutexvar_epi16(pairs, both));
                }
            }
        }
    }
}

// FP8: a row of x [K] (float32, zero past K) rounded through e4m3 as fake_quant_row rounds it but left unscaled
// (the e4m3 values); returns the row's scale
static float round_row_e4m3(const Call& c, float* x, int64_t Kp) {
    float s = c.act_scale;
    if (c.act == kActToken) {
        float amax = 0.f;
        for (int64_t k = 0; k < c.K; ++k) amax = std::max(amax, std::fabs(x[k]));
        s = std::max(amax, 1e-12f) / 448.f;
    }
    const __m256 sv = _mm256_set1_ps(s), hi = _mm256_set1_ps(448.f), lo = _mm256_set1_ps(-448.f);
    for (int64_t k = 0; k < Kp; k += 8) {
        const __m256 q = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), sv), lo), hi);
        _mm256_storeu_ps(x + k, round_e4m3(q));
    }
    return s;
}

// y = x W^T + b for bf16 x [M, K]: W dequantized by V a panel at a time, the products on the tile unit (FP8: x
// rounded through e4m3 first, the row and column scales applied to the sums)
template <typename V>
static void amx_dequant_linear(const Call& c) {
    constexpr bool kFp8 = std::is_same_v<V, Fp8V>;
    const int64_t Kp = (c.K + 7) / 8 * 8, K32 = (c.K + kTileK - 1) / kTileK * kTileK, Mp = (c.M + 15) / 16 * 16;
    const int64_t panels = (c.N + kPanel - 1) / kPanel, groups = (Kp + c.group - 1) / c.group;
    const int64_t panel_lanes = Kp / V::E * kPanel, steps = K32 / kTileK;
    const uint32_t* W = (const uint32_t*)c.w;
    // x as A tiles [Mp / 16, steps, 16 rows, 32 K], zero past M and K: each tile 1 KB in one piece, so a row
    // block's tiles are one sequential stream (16 rows K32 apart were 16 streams the prefetchers lost)
    static thread_local std::vector<bf16> xt;
    static thread_local std::vector<float> row_f32, row_scales;
    xt.assign(Mp * K32, bf16{});
    if (kFp8) row_f32.assign(Kp, 0.f), row_scales.resize(c.M);
    for (int64_t m = 0; m < c.M; ++m) {
        const bf16* row = (const bf16*)c.x + m * c.ldx;
        bf16* dst = xt.data() + (m / 16) * 16 * K32 + (m % 16) * kTileK;
        if (kFp8) {  // the e4m3 values of the row, exact in bf16, 8 at a time (zero past K)
            float* f = row_f32.data();
            int64_t k = 0;
            for (; k + 8 <= c.K; k += 8) _mm256_storeu_ps(f + k, load8(row, k, true));
            for (; k < c.K; ++k) f[k] = load1(row, k, true);
            row_scales[m] = round_row_e4m3(c, f, Kp);
            for (k = 0; k < Kp; k += 8)
                _mm_storeu_si128((__m128i*)(dst + (k / kTileK) * 16 * kTileK + k % kTileK),
                                 (__m128i)_mm256_cvtneps_pbh(_mm256_loadu_ps(f + k)));
            continue;
        }
        for (int64_t k0 = 0; k0 < c.K; k0 += kTileK)
            std::memcpy(dst + k0 * 16, row + k0, std::min(kTileK, c.K - k0) * sizeof(bf16));
    }
    const bf16* X = xt.data();  // (the thread_local vectors are this thread's: the workers take the pointers)
    const float* row_scale = row_scales.data();
    constexpr int64_t stride = kTileK * sizeof(bf16);
#pragma omp parallel num_threads(c.threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        if (p0 < p1) {
            amx_tiles::configure();
            // panels dequantized together (~1 MB of bf16 tiles, in L2): every row block of x then runs over all of
            // them, so the output is written a few hundred bytes of a row at a time, not 64 bytes rows far apart
            const int64_t tile_words = steps * 2 * 256, together = std::clamp<int64_t>((1 << 18) / tile_words, 1, 16);
            static thread_local std::vector<uint32_t> buf;
            buf.resize(together * tile_words);
            alignas(64) float sums[32 * kPanel];
            for (int64_t pg = p0; pg < p1; pg += together) {
                const int64_t pn = std::min(together, p1 - pg);
                for (int64_t i = 0; i < pn; ++i)
                    dequant_panel_bf16<V>(c, W + (pg + i) * panel_lanes, (pg + i) * groups * kPanel, Kp, K32,
                                          buf.data() + i * tile_words);
                for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
                    const bool two = m0 + 16 < Mp;  // a second 16-row block
                    const bf16* a = X + m0 * K32;
                    for (int64_t i = 0; i < pn; ++i) {
                        const int64_t p = pg + i, ncols = std::min(kPanel, c.N - p * kPanel);
                        const uint32_t* bp = buf.data() + i * tile_words;
                        // A tiles 1 KB a step; B tiles as dequant_panel_bf16 laid them out, 2 KB a step
                        amx_tiles::panel_sums<amx_tiles::Bf16Dot>(a, 1024, 32 * K32, bp, 2048, 1024, 64, steps, two,
                                                                  sums);
                        __m256 b[4], ws[4];
                        panel_bias(c, p, ncols, b);
                        if (kFp8)  // the panel's column scales (one group: float32 [32] per panel)
                            UNROLL for (int j = 0; j < 4; ++j)
                                ws[j] = _mm256_loadu_ps((const float*)c.scales + p * groups * kPanel + 8 * j);
                        for (int64_t r = 0; r < std::min<int64_t>(32, c.M - m0); ++r) {
                            __m256 v[4];
                            UNROLL for (int j = 0; j < 4; ++j) {
                                v[j] = _mm256_loadu_ps(sums + r * kPanel + 8 * j);
                                if (kFp8)
                                    v[j] = _mm256_mul_ps(_mm256_mul_ps(v[j], _mm256_set1_ps(row_scale[m0 + r])),
                                                         ws[j]);
                                v[j] = _mm256_add_ps(v[j], b[j]);
                            }
                            store_row(c, m0 + r, p, ncols, v);
                        }
                    }
                }
            }
            _tile_release();
        }
    }
}

// Whether the AMX path can run this call: bf16 x, the tile state granted; FP8 with one scale per column and x
// rounded per token or by a static scale
static bool amx_serves(const Call& c, bool fp8) {
    return c.bf16 && amx_permitted() && (!fp8 || (c.group >= (c.K + 7) / 8 * 8 && (c.act == kActToken ||
                                                                                  c.act == kActStatic)));
}
#else
constexpr int64_t kAmx = 0;
static bool amx_permitted() { return false; }
template <int kBits>
struct IntV {};
struct Fp8V {};
static bool amx_serves(const Call&, bool) { return false; }
template <typename V>
static void amx_dequant_linear(const Call&) {}
#endif

}  // namespace quant
