// W8A8 INT8 on AVX2 (vpmaddwd) or AVX512-VNNI (vpdpwssd on ymm), included by quant_linear.cpp after
// quant_linear_avx2.cpp (its Call, chunking and output rows). Packed: int8 [N/32, Kp/2, 32, 2] (column c's pair
// (k, k+1) at 32-bit lane c of a panel row, Kp = K rounded up to even), scales float32 [N/32 * 32].
// x is quantized per row here to int16 lanes: pairs of int16 products summed into int32 by vpmaddwd are exact (an
// int8 x int8 vpmaddubsw would saturate at 2 x 128 x 128), as are the int32 sums (|sum| <= K * 2^14).
namespace quant {

// inductor builds with -march=native, which defines these where the CPU has them (a `#pragma GCC target` would not:
// g++ lexes the file before it applies one, so no macro changes)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(VLSERVE_FORCE_AVX2)
#define QUANT_VNNI 1
constexpr int64_t kVnni = 1;  // INT8 sums through vpdpwssd (a vpmaddwd and its add in one instruction)
#else
constexpr int64_t kVnni = 0;
#endif

constexpr int64_t kIntDepth = 128;  // panel rows (K pairs) per pass over the row blocks (4 KB a half panel)
// rows of a register block (x 16 columns): vpmaddwd writes a temporary that vpaddd then adds, so 6 x 2
// accumulators spill; 4 ran 1.3x faster than 3 at 32 rows, and as fast as 5
constexpr int64_t kIntRows = 4;

// One row of x (K values, float32 or bf16) -> Q [ldq] (int16 or int8; zero past K) and its scale, as
// quantize_rows_int8 computes them: s = max(absmax, 1e-10) / 127.5 (compressed-tensors' scale), q =
// round-half-even(x / s) clamped to [-128, 127]
template <typename Q>
static float quantize_row(const void* in, int64_t K, bool is_bf16, Q* out, int64_t ldq) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 mx = avx2::zero();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, load8(in, k, is_bf16)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx);
    float amax = 0.f;
    for (float v : lanes) amax = std::max(amax, v);
    for (; k < K; ++k) amax = std::max(amax, std::fabs(load1(in, k, is_bf16)));
    const float s = std::max(amax, 1e-10f) / 127.5f;
    const __m256 sv = _mm256_set1_ps(s);
    const __m256i lo = _mm256_set1_epi32(-128), hi = _mm256_set1_epi32(127);
    auto quant8 = [&](int64_t at) {
        const __m256 t = _mm256_round_ps(_mm256_div_ps(load8(in, at, is_bf16), sv),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        return _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(t), lo), hi);
    };
    for (k = 0; k + 16 <= K; k += 16) {  // packs interleaves 128-bit lanes: 0-3, 8-11, 4-7, 12-15 -> reorder
        const __m256i q16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(quant8(k), quant8(k + 8)), 0xd8);
        if constexpr (sizeof(Q) == 2) {
            _mm256_storeu_si256((__m256i*)(out + k), q16);
        } else {  // 16 int16 in order -> 16 int8 (in range already: no saturation)
            const __m128i q8 = _mm_packs_epi16(_mm256_castsi256_si128(q16), _mm256_extracti128_si256(q16, 1));
            _mm_storeu_si128((__m128i*)(out + k), q8);
        }
    }
    for (; k < K; ++k) out[k] = Q(std::min(127.f, std::max(-128.f, std::nearbyint(load1(in, k, is_bf16) / s))));
    std::fill(out + K, out + ldq, Q(0));
    return s;
}

// rows [m, m + rows) of x -> int16 [rows, ldq] and their scales (quantize_row)
static void quantize_rows(const Call& c, int64_t m, int64_t rows, int64_t ldq, int16_t* q, float* xs) {
    for (int64_t r = 0; r < rows; ++r)
        xs[r] = quantize_row(c.x_row(m + r), c.K, c.bf16, q + r * ldq, ldq);
}

static inline __m256i dot2(__m256i acc, __m256i w, __m256i x) {  // acc + w[2i] x[2i] + w[2i+1] x[2i+1], exact
#if defined(QUANT_VNNI)
    return _mm256_dpwssd_epi32(acc, w, x);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(w, x), acc);
#endif
}

// sums [R, 8V] (+)= xq [R, 2 * pairs] (int16, rows ldq apart) . pairs panel rows from a column offset (int8 pairs,
// widened to int16 in registers); int32 sums, `sums` rows kPanel apart. Not inlined: inside the caller GCC copies
// every accumulator between registers (and one through the stack) on every step.
template <int R, int V>
__attribute__((noinline)) static void itile(const int16_t* x, int64_t ldq, const int8_t* w, int64_t pairs,
                                            int32_t* sums, bool first) {
    __m256i acc[R][V];
    UNROLL for (int r = 0; r < R; ++r) UNROLL for (int v = 0; v < V; ++v)
        acc[r][v] = first ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i*)(sums + r * kPanel + 8 * v));
    for (int64_t s = 0; s < pairs; ++s, w += 2 * kPanel, x += 2) {
        __m256i wv[V];
        UNROLL for (int v = 0; v < V; ++v) wv[v] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 16 * v)));
        UNROLL for (int r = 0; r < R; ++r) {
            int32_t pair;
            std::memcpy(&pair, x + r * ldq, sizeof(pair));
            const __m256i xr = _mm256_set1_epi32(pair);
            UNROLL for (int v = 0; v < V; ++v) acc[r][v] = dot2(acc[r][v], wv[v], xr);
        }
    }
    UNROLL for (int r = 0; r < R; ++r) UNROLL for (int v = 0; v < V; ++v)
        _mm256_storeu_si256((__m256i*)(sums + r * kPanel + 8 * v), acc[r][v]);
}

template <int V>  // 1 <= rows < kIntRows (rows <= 2 where V = 4)
static inline void itail(int64_t rows, const int16_t* x, int64_t ldq, const int8_t* w, int64_t pairs, int32_t* sums,
                         bool first) {
    switch (rows) {
        case 1: itile<1, V>(x, ldq, w, pairs, sums, first); break;
        case 2: itile<2, V>(x, ldq, w, pairs, sums, first); break;
        case 3: if constexpr (V == 2) itile<3, V>(x, ldq, w, pairs, sums, first); break;
        case 4: if constexpr (V == 2) itile<4, V>(x, ldq, w, pairs, sums, first); break;
        case 5: if constexpr (V == 2) itile<5, V>(x, ldq, w, pairs, sums, first); break;
        default: break;
    }
}

// W8A8: y = (float(sum_k xq wq) * xs) * ws + b, as int8_linear_ref computes it (the same float32 operations)
static void int8_linear(const Call& c) {
    const int64_t Kp = (c.K + 1) / 2 * 2, pairs = Kp / 2, panels = (c.N + kPanel - 1) / kPanel;
    const int8_t* W = (const int8_t*)c.w;
    const float* S = (const float*)c.scales;
    avx2::split_work(c.M, panels, c.threads, [&](int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
        alignas(64) int32_t sums[kChunk * kPanel];
        float xs[kChunk];
        static thread_local std::vector<int16_t> xq;  // the chunk's rows quantized, as int16
        const int64_t ldq = (Kp + 15) / 16 * 16 + 16;
        for (int64_t m = m0; m < m1; m += kChunk) {
            const int64_t rows = std::min(kChunk, m1 - m), full = rows / kIntRows * kIntRows, rest = rows - full;
            if ((int64_t)xq.size() < rows * ldq) xq.resize(rows * ldq);
            quantize_rows(c, m, rows, ldq, xq.data(), xs);
            for (int64_t p = p0; p < p1; ++p) {
                const int8_t* panel = W + p * Kp * kPanel;
                for (int64_t s0 = 0; s0 < pairs; s0 += kIntDepth) {
                    const int64_t n = std::min(kIntDepth, pairs - s0);
                    const bool first = s0 == 0;
                    const int16_t* xk = xq.data() + 2 * s0;
                    const int8_t* wk = panel + s0 * 2 * kPanel;
                    for (int64_t half = 0; half < 2; ++half) {
                        for (int64_t r = 0; r < full; r += kIntRows)
                            itile<kIntRows, 2>(xk + r * ldq, ldq, wk + half * 32, n, sums + r * kPanel + half * 16,
                                               first);
                        if (rest > 2)
                            itail<2>(rest, xk + full * ldq, ldq, wk + half * 32, n, sums + full * kPanel + half * 16,
                                     first);
                    }
                    if (rest && rest <= 2) itail<4>(rest, xk + full * ldq, ldq, wk, n, sums + full * kPanel, first);
                }
                const int64_t ncols = std::min(kPanel, c.N - p * kPanel);
                __m256 b[4], ws[4];
                panel_bias(c, p, ncols, b);
                UNROLL for (int i = 0; i < 4; ++i) ws[i] = _mm256_loadu_ps(S + p * kPanel + 8 * i);
                for (int64_t r = 0; r < rows; ++r) {
                    const __m256 xr = _mm256_set1_ps(xs[r]);
                    __m256 v[4];
                    UNROLL for (int i = 0; i < 4; ++i) {
                        const __m256i acc = _mm256_loadu_si256((const __m256i*)(sums + r * kPanel + 8 * i));
                        v[i] = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), xr), ws[i]), b[i]);
                    }
                    store_row(c, m + r, p, ncols, v);
                }
            }
        }
    });
}

// x [M, K] -> int8 out [M, ldo] and float32 scales [M] (written to c.scales), as quantize_rows_int8: the activation
// side of W8A8 when torch's int8 matmul (oneDNN, AMX tiles) multiplies
static void quantize_rows_int8(const Call& c) {
    float* xs = (float*)c.scales;
#pragma omp parallel for num_threads(c.threads) schedule(static) if (c.M * c.K >= (1 << 15))
    for (int64_t m = 0; m < c.M; ++m) xs[m] = quantize_row(c.x_row(m), c.K, c.bf16, (int8_t*)c.out + m * c.ldo, c.K);
}

// int32 sums acc [M, N] (c.x, rows ldx apart; c.act 1: already as float32), row scales xs [M] (c.w), column
// scales ws [N] (c.scales) -> out = (float(acc) * xs) * ws + b in the output dtype: int8_linear's epilogue, the same
// float32 operations
static void int8_epilogue(const Call& c) {
    const int32_t* A = (const int32_t*)c.x;
    const bool float_sums = c.act == 1;
    const float* XS = (const float*)c.w;
    const float* S = (const float*)c.scales;
    const int64_t panels = (c.N + kPanel - 1) / kPanel;
#pragma omp parallel for num_threads(c.threads) schedule(static) if (c.M * c.N >= (1 << 16))
    for (int64_t m = 0; m < c.M; ++m) {
        const __m256 xr = _mm256_set1_ps(XS[m]);
        for (int64_t p = 0; p < panels; ++p) {
            const int64_t n0 = p * kPanel, ncols = std::min(kPanel, c.N - n0);
            alignas(32) int32_t acc[kPanel] = {};
            alignas(32) float ws[kPanel] = {};
            std::copy(A + m * c.ldx + n0, A + m * c.ldx + n0 + ncols, acc);
            std::copy(S + n0, S + n0 + ncols, ws);
            __m256 b[4], v[4];
            panel_bias(c, p, ncols, b);
            UNROLL for (int i = 0; i < 4; ++i) {
                const __m256i lanes = _mm256_load_si256((const __m256i*)(acc + 8 * i));
                const __m256 a = float_sums ? _mm256_castsi256_ps(lanes) : _mm256_cvtepi32_ps(lanes);
                v[i] = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(a, xr), _mm256_load_ps(ws + 8 * i)), b[i]);
            }
            store_row(c, m, p, ncols, v);
        }
    }
}

}  // namespace quant
