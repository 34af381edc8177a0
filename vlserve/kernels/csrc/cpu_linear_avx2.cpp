// The packed linear on AVX2 + FMA (8-lane ymm registers, 16 of them), included by cpu_linear.cpp. Same packed
// layouts and epilogues as the AVX-512 path; valid code under AVX-512 flags too, where VLSERVE_CPU_ISA=avx2 forces
// it and where bf16 goes through it on CPUs without AVX512-BF16.
//
// Per thread: for each chunk of rows (16 register blocks, copied once to a float32 scratch, bf16 widened), for each of
// its panels, K in blocks of kDepth panel rows; in each block the panel is walked as two 16-column halves (panel rows
// stay 32 columns apart), each half by register blocks of P::kRows rows x 16 columns (2 weight vectors, a broadcast
// x value, 2 x kRows accumulators). Blocks of 1 or 2 rows take all 32 columns at once, so a decode step reads each
// panel row once. The sums wait in a float32 [rows, 32] scratch between K blocks; the epilogue reads them at the end.
namespace avx2 {

constexpr int64_t kChunkBlocks = 16;  // row blocks whose products with a panel are computed before the next panel
// Panel rows per pass over the row blocks: a half panel's block (a 64-byte line per row, every other line of the
// panel, so half of L1's sets) takes 4 of their 8 ways, leaving room for the x rows
constexpr int64_t kDepth = 128;

static inline __m256 zero() { return _mm256_setzero_ps(); }

// f(m0, m1, p0, p1) once per thread: rows [m0, m1) against panels [p0, p1). Each thread takes a contiguous range of
// the panels for all rows, or where there are fewer panels than threads, a range of the rows for all panels.
template <typename F>
static void split_work(int64_t M, int64_t panels, int64_t threads, const F& f) {
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        if (panels >= nt) f(0, M, panels * t / nt, panels * (t + 1) / nt);
        else if (M * (t + 1) / nt > M * t / nt) f(M * t / nt, M * (t + 1) / nt, 0, panels);
    }
}

// 8 bf16 -> 8 float32 (exact: bf16 is the top half of a float32)
static inline __m256 widen8(const bf16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// 8 float32 -> their bf16 bits (round to nearest even; NaN -> 0x7fc0, as torch rounds), one per 32-bit lane
static inline __m256i bf16_bits(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
}

// How a register block multiplies: F32 reads float32 panels [K, 32], one K position per panel row; Bf16 reads
// bf16 panels [K/2, 32, 2], whose 32-bit lane c of a panel row holds column c's pair (k, k+1): `lane << 16` is
// the k value as float32, `lane & 0xffff0000` the k+1 value. x is float32 either way (bf16 rows are widened first).
struct F32 {
    using T = float;
    static constexpr int64_t kStep = 1;  // K positions per panel row
    static constexpr int64_t kRows = 6;  // rows of the register block
    template <int R, int V>  // R rows x V vectors of 8 columns, at w (one panel row), x rows ldx apart
    static inline void step(__m256 (&acc)[R][V], const float* w, const float* x, int64_t ldx) {
        __m256 wv[V];
        UNROLL for (int v = 0; v < V; ++v) wv[v] = _mm256_loadu_ps(w + 8 * v);
        UNROLL for (int r = 0; r < R; ++r) {
            const __m256 xr = _mm256_broadcast_ss(x + r * ldx);
            UNROLL for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(xr, wv[v], acc[r][v]);
        }
    }
    static inline __m256 widen(const float* p) { return _mm256_loadu_ps(p); }
    static inline __m256 round(__m256 v) { return v; }  // to T's precision
    static inline void store(float* c, const __m256 (&v)[4]) {
        UNROLL for (int i = 0; i < 4; ++i) _mm256_storeu_ps(c + 8 * i, v[i]);
    }
};

struct Bf16 {
    using T = bf16;
    static constexpr int64_t kStep = 2;
    static constexpr int64_t kRows = 5;  // 10 accumulators: with 12, GCC spills some on every step
    template <int R, int V>
    static inline void step(__m256 (&acc)[R][V], const bf16* w, const float* x, int64_t ldx) {
        const __m256i* lanes = (const __m256i*)w;
        __m256 wv[V];
        UNROLL for (int v = 0; v < V; ++v) wv[v] = _mm256_castsi256_ps(_mm256_slli_epi32(load(lanes + v), 16));
        UNROLL for (int r = 0; r < R; ++r) {
            const __m256 xr = _mm256_broadcast_ss(x + r * ldx);
            UNROLL for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(xr, wv[v], acc[r][v]);
        }
        const __m256i high = _mm256_set1_epi32(int32_t(0xffff0000u));
        UNROLL for (int v = 0; v < V; ++v) wv[v] = _mm256_castsi256_ps(_mm256_and_si256(load(lanes + v), high));
        UNROLL for (int r = 0; r < R; ++r) {
            const __m256 xr = _mm256_broadcast_ss(x + r * ldx + 1);
            UNROLL for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(xr, wv[v], acc[r][v]);
        }
    }
    static inline __m256i load(const __m256i* p) { return _mm256_loadu_si256(p); }
    static inline __m256 widen(const bf16* p) { return widen8(p); }
    static inline __m256 round(__m256 v) {  // to bf16 (nearest even) and back
        return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
    }
    static inline void store(bf16* c, const __m256 (&v)[4]) {
        UNROLL for (int i = 0; i < 4; i += 2) {  // packus interleaves 128-bit lanes: 0-3, 8-11, 4-7, 12-15 -> reorder
            const __m256i packed = _mm256_packus_epi32(bf16_bits(v[i]), bf16_bits(v[i + 1]));
            _mm256_storeu_si256((__m256i*)(c + 8 * i), _mm256_permute4x64_epi64(packed, 0xd8));
        }
    }
};

// exp(x) to about an ulp, as the AVX-512 path computes it: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes'
// degree-6 polynomial, times 2^n built in the exponent bits as 2^(n>>1) * 2^(n - (n>>1)): both factors are normal
// floats, so the product overflows to inf and underflows to 0 as vscalefps does
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.f)), _mm256_set1_ps(89.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: n * ln2 exact enough
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

static inline __m256 silu(__m256 g) {  // g / (1 + exp(-g)), torch's formula
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(zero(), g))));
}

// sums[R rows, 8V columns] (+)= x[R, steps * kStep] (rows ldx apart) . w (steps panel rows from a column offset);
// `sums` rows are kPanel floats apart; `first`: start from 0 instead of the sums of the previous K blocks
template <typename P, int R, int V>
static inline void tile(const float* x, int64_t ldx, const typename P::T* w, int64_t steps, float* sums, bool first) {
    __m256 acc[R][V];
    UNROLL for (int r = 0; r < R; ++r)
        UNROLL for (int v = 0; v < V; ++v) acc[r][v] = first ? zero() : _mm256_loadu_ps(sums + r * kPanel + 8 * v);
    for (int64_t s = 0; s < steps; ++s, w += kPanel * P::kStep, x += P::kStep) P::template step<R, V>(acc, w, x, ldx);
    UNROLL for (int r = 0; r < R; ++r)
        UNROLL for (int v = 0; v < V; ++v) _mm256_storeu_ps(sums + r * kPanel + 8 * v, acc[r][v]);
}

template <typename P, int V>  // 1 <= rows < kRows (rows <= 2 where V = 4: 8 accumulators)
static inline void tail(int64_t rows, const float* x, int64_t ldx, const typename P::T* w, int64_t steps, float* sums,
                        bool first) {
    switch (rows) {
        case 1: tile<P, 1, V>(x, ldx, w, steps, sums, first); break;
        case 2: tile<P, 2, V>(x, ldx, w, steps, sums, first); break;
        case 3: if constexpr (V == 2) tile<P, 3, V>(x, ldx, w, steps, sums, first); break;
        case 4: if constexpr (V == 2) tile<P, 4, V>(x, ldx, w, steps, sums, first); break;
        case 5: if constexpr (V == 2) tile<P, 5, V>(x, ldx, w, steps, sums, first); break;
        default: break;
    }
}

// sums[rows, 32] = x[rows, K] . panel [K, 32] (float32 sums, no bias yet)
template <typename P>
static void panel_sums(const float* x, int64_t ldx, const typename P::T* panel, int64_t K, int64_t rows, float* sums) {
    const int64_t steps = K / P::kStep, depth = kDepth;
    const int64_t full = rows / P::kRows * P::kRows, rest = rows - full;  // rows in whole register blocks; the rest
    for (int64_t s0 = 0; s0 < steps; s0 += depth) {
        const int64_t n = std::min(depth, steps - s0);
        const float* xk = x + s0 * P::kStep;
        const typename P::T* wk = panel + s0 * kPanel * P::kStep;
        const bool first = s0 == 0;
        for (int64_t half = 0; half < 2; ++half) {  // columns 0-15, then 16-31
            const typename P::T* wh = wk + half * 16 * P::kStep;
            for (int64_t r = 0; r < full; r += P::kRows)
                tile<P, P::kRows, 2>(xk + r * ldx, ldx, wh, n, sums + r * kPanel + half * 16, first);
            if (rest > 2) tail<P, 2>(rest, xk + full * ldx, ldx, wh, n, sums + full * kPanel + half * 16, first);
        }
        if (rest && rest <= 2) tail<P, 4>(rest, xk + full * ldx, ldx, wk, n, sums + full * kPanel, first);
    }
}

// The epilogue of rows x 32 sums (see Epilogue): bias added (and with kAdd, add's rows [rows, 32], ldadd apart),
// then stored (rounded to T once), kept as the gate (rounded to T), taken as up: silu(gate) rounded to T times up
// rounded to T, as two elementwise ops would round, or stored as SiLU of the sums rounded to T (kStoreSilu)
template <typename P, int E, bool kAdd = false>
static void finish(const float* sums, int64_t rows, const typename P::T* bias, typename P::T* c, int64_t ldc,
                   int64_t ncols, float* gate, const float* add = nullptr, int64_t ldadd = 0) {
    using T = typename P::T;
    T padded[kPanel] = {};  // the bias of a ragged last panel, zero-padded: bias[N] ends there
    if (bias && ncols < kPanel) {
        std::copy(bias, bias + ncols, padded);
        bias = padded;
    }
    __m256 b[4];
    UNROLL for (int i = 0; i < 4; ++i) b[i] = bias ? P::widen(bias + 8 * i) : zero();
    for (int64_t r = 0; r < rows; ++r) {
        __m256 v[4];
        UNROLL for (int i = 0; i < 4; ++i) v[i] = _mm256_add_ps(_mm256_loadu_ps(sums + r * kPanel + 8 * i), b[i]);
        if constexpr (kAdd) {
            UNROLL for (int i = 0; i < 4; ++i) v[i] = _mm256_add_ps(v[i], _mm256_loadu_ps(add + r * ldadd + 8 * i));
        }
        if constexpr (E == kGate) {
            UNROLL for (int i = 0; i < 4; ++i) _mm256_storeu_ps(gate + r * kPanel + 8 * i, P::round(v[i]));
            continue;
        }
        if constexpr (E == kSiluMul) {
            UNROLL for (int i = 0; i < 4; ++i)
                v[i] = _mm256_mul_ps(P::round(silu(_mm256_loadu_ps(gate + r * kPanel + 8 * i))), P::round(v[i]));
        }
        if constexpr (E == kStoreSilu) {
            UNROLL for (int i = 0; i < 4; ++i) v[i] = silu(P::round(v[i]));
        }
        if (ncols == kPanel) {
            P::store(c + r * ldc, v);
        } else {  // the last panel of an N that is not a multiple of 32
            T row[kPanel];
            P::store(row, v);
            std::copy(row, row + ncols, c + r * ldc);
        }
    }
}

// kAdd (with kSilu): add [M, 2N] float32 (rows ldadd apart) joins the gate and up sums before the activation;
// kAct (without kSilu): SiLU of each output
template <typename P, bool kSilu, bool kAdd, bool kAct = false>
static void linear(const void* a, int64_t lda, const void* packed, const void* bias, void* c, int64_t ldc, int64_t M,
                   int64_t N, int64_t K, int64_t threads, const float* add, int64_t ldadd) {
    using T = typename P::T;
    const T* A = (const T*)a;
    const T* W = (const T*)packed;
    const T* B = (const T*)bias;
    T* C = (T*)c;
    const int64_t panels = (N + kPanel - 1) / kPanel, panel_size = K * kPanel;  // with SiLU, up's panels follow
    constexpr int64_t chunk = kChunkBlocks * P::kRows;
    split_work(M, panels, threads, [&](int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
        alignas(64) float sums[chunk * kPanel], gate[chunk * kPanel];
        // the chunk's rows as float32 (bf16 widened), ldx apart: padded, as rows a multiple of 4 KB apart would
        // share L1 sets (the register block reads 5-6 rows at once)
        static thread_local std::vector<float> rows_f32;
        const int64_t ldx = (K + 15) / 16 * 16 + 16;
        for (int64_t m = m0; m < m1; m += chunk) {
            const int64_t rows = std::min(chunk, m1 - m);
            if ((int64_t)rows_f32.size() < rows * ldx) rows_f32.resize(rows * ldx);
            for (int64_t r = 0; r < rows; ++r) {
                const T* in = A + (m + r) * lda;
                float* out = rows_f32.data() + r * ldx;
                int64_t k = 0;
                for (; k + 8 <= K; k += 8) _mm256_storeu_ps(out + k, P::widen(in + k));
                for (; k < K; ++k) out[k] = to_float(in[k]);
            }
            const float* x = rows_f32.data();
            for (int64_t p = p0; p < p1; ++p) {
                T* cp = C + m * ldc + p * kPanel;
                const int64_t ncols = std::min(kPanel, N - p * kPanel);
                panel_sums<P>(x, ldx, W + p * panel_size, K, rows, sums);
                if constexpr (kSilu) {  // gate panel p, then up panel p (N / 32 panels further)
                    const float* ap = kAdd ? add + m * ldadd + p * kPanel : nullptr;  // gate's addend; up's: + N
                    finish<P, kGate, kAdd>(sums, rows, B ? B + p * kPanel : nullptr, cp, ldc, ncols, gate, ap, ldadd);
                    panel_sums<P>(x, ldx, W + (panels + p) * panel_size, K, rows, sums);
                    finish<P, kSiluMul, kAdd>(sums, rows, B ? B + N + p * kPanel : nullptr, cp, ldc, ncols, gate,
                                              kAdd ? ap + N : nullptr, ldadd);
                } else {
                    finish<P, kAct ? kStoreSilu : kStore>(sums, rows, B ? B + p * kPanel : nullptr, cp, ldc, ncols, gate);
                }
            }
        }
    });
}

}  // namespace avx2
