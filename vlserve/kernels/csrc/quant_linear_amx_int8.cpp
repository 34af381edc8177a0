// W8A8 INT8 on AMX (int8 tiles), included by quant_linear.cpp after amx_tiles.h (the tile choreography) and
// quant_linear_int8.cpp (quantize_row, the epilogue's arithmetic). The matrix is packed once for the tile unit
// (quant_linear_cpu.pack_int8_amx): int8 [N/32, K64/64, 2, 16, 16, 4], i.e. per panel of 32 columns and K step of
// 64, two B tiles (columns 0-15 and 16-31), tile row r holding the 4 K positions 64 s + 4 r .. + 3 of each of its
// 16 columns. x is quantized per row as quantize_rows_int8 does and laid out as A tiles; tdpbssd sums the int8
// products exactly in int32, so the output is the reference's bit for bit: (float(acc) * xs) * ws + b.
namespace quant {

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512VL__) && !defined(VLSERVE_FORCE_AVX2)
constexpr int64_t kAmxInt8 = 1;
constexpr int64_t kTileKInt8 = 64;  // K positions of one tile step (16 quads)

// One output row's 32 values of panel p: (float(acc) * xs) * ws + b, int8_linear's float32 operations
static inline void rescale_row(const int32_t* acc, float xs, const __m256 (&ws)[4], const __m256 (&b)[4],
                               __m256 (&v)[4]) {
    const __m256 xr = _mm256_set1_ps(xs);
    UNROLL for (int i = 0; i < 4; ++i) {
        const __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)(acc + 8 * i))), xr);
        v[i] = _mm256_add_ps(_mm256_mul_ps(a, ws[i]), b[i]);
    }
}

// y = x W^T + b; with silu_mul, W is a gate_up matrix [2N, K] (gate panels, then up panels; N % 32 == 0) and
// y = silu(gate) * up [M, N], rounded as the unfused ops round (gate and up to the output dtype, silu to it, then
// the product), the projection never written out
static void amx_int8_linear(const Call& c, bool silu_mul) {
    const int64_t K64 = (c.K + kTileKInt8 - 1) / kTileKInt8 * kTileKInt8, steps = K64 / kTileKInt8;
    const int64_t Mp = (c.M + 15) / 16 * 16, panels = (c.N + kPanel - 1) / kPanel;
    const int8_t* W = (const int8_t*)c.w;
    const float* S = (const float*)c.scales;
    // x quantized per row, as A tiles [Mp / 16, steps, 16 rows, 64 K] (zero past M and K), and its row scales
    static thread_local std::vector<int8_t> xt;
    static thread_local std::vector<float> xs;
    xt.resize(Mp * K64);  // every element written once below: x's rows quantized (zero past K), the pad rows zeroed
    xs.resize(c.M);
    int8_t* const X = xt.data();  // (the thread_local vectors are this thread's: the workers take the pointers)
    float* const XS = xs.data();
#pragma omp parallel num_threads(c.threads) if (c.M * c.K >= (1 << 15))
    {
        std::vector<int8_t> row(K64);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < c.M; ++m) {
            XS[m] = quantize_row(c.x_row(m), c.K, c.bf16, row.data(), K64);
            int8_t* dst = X + (m / 16) * 16 * K64 + (m % 16) * kTileKInt8;
            for (int64_t s = 0; s < steps; ++s)
                std::memcpy(dst + s * 16 * kTileKInt8, row.data() + s * kTileKInt8, kTileKInt8);
        }
    }
    for (int64_t m = c.M; m < Mp; ++m)
        for (int64_t s = 0; s < steps; ++s)
            std::memset(X + (m / 16) * 16 * K64 + (m % 16) * kTileKInt8 + s * 16 * kTileKInt8, 0, kTileKInt8);
#pragma omp parallel num_threads(c.threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        if (p0 < p1) {
            amx_tiles::configure();
            alignas(64) int32_t sums[32 * kPanel], up_sums[32 * kPanel];
            const int64_t panel_bytes = steps * 2 * 1024;
            for (int64_t p = p0; p < p1; ++p) {
                const int64_t ncols = std::min(kPanel, c.N - p * kPanel), up = p + panels;  // (up: silu_mul)
                __m256 b[4], ws[4], ub[4], uws[4];
                panel_bias(c, p, ncols, b);
                UNROLL for (int i = 0; i < 4; ++i) ws[i] = _mm256_loadu_ps(S + p * kPanel + 8 * i);
                if (silu_mul) {
                    panel_bias(c, up, ncols, ub);
                    UNROLL for (int i = 0; i < 4; ++i) uws[i] = _mm256_loadu_ps(S + up * kPanel + 8 * i);
                }
                for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
                    const bool two = m0 + 16 < Mp;  // a second 16-row block
                    // A tiles 1 KB a step; B tiles as pack_int8_amx laid them out, 2 KB a step
                    auto sums_of = [&](int64_t panel, int32_t* out) {
                        amx_tiles::panel_sums<amx_tiles::Int8Dot>(X + m0 * K64, 1024, 16 * K64, W + panel * panel_bytes,
                                                                  2048, 1024, 64, steps, two, out);
                    };
                    sums_of(p, sums);
                    if (silu_mul) sums_of(up, up_sums);
                    for (int64_t r = 0; r < std::min<int64_t>(32, c.M - m0); ++r) {
                        __m256 v[4];
                        rescale_row(sums + r * kPanel, XS[m0 + r], ws, b, v);
                        if (silu_mul) {
                            __m256 u[4];
                            rescale_row(up_sums + r * kPanel, XS[m0 + r], uws, ub, u);
                            UNROLL for (int i = 0; i < 4; ++i)
                                v[i] = c.bf16 ? _mm256_mul_ps(avx2::Bf16::round(avx2::silu(avx2::Bf16::round(v[i]))),
                                                              avx2::Bf16::round(u[i]))
                                              : _mm256_mul_ps(avx2::silu(v[i]), u[i]);
                        }
                        store_row(c, m0 + r, p, ncols, v);
                    }
                }
            }
            _tile_release();
        }
    }
}
#else
constexpr int64_t kAmxInt8 = 0;
static void amx_int8_linear(const Call&, bool) {}
#endif

}  // namespace quant
