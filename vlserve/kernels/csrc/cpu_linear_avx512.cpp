// The packed linear on AVX-512, included by cpu_linear.cpp where the source is built for AVX-512: float32 through
// FMAs, bf16 through vdpbf16ps where the CPU has AVX512-BF16 (the source is then built for that target; without
// it, bf16 takes the AVX2 path's widening code).
namespace avx512 {

constexpr int64_t kRows = 8;       // rows of the register block
constexpr int64_t kRowChunk = 64;  // rows whose products with a panel are computed before the next panel
// float32's: its panels are twice bf16's bytes, so each one read from memory serves more rows
constexpr int64_t kF32RowChunk = 256;

// The lanes of columns 0-15 and 16-31 of a 32-column panel row that hold one of its first `ncols` columns
struct ColumnMasks {
    __mmask16 lo, hi;
    explicit ColumnMasks(int64_t ncols)
        : lo(ncols >= 16 ? 0xffff : (1u << ncols) - 1),
          hi(ncols >= 32 ? 0xffff : ncols <= 16 ? 0 : (1u << (ncols - 16)) - 1) {}
};

// 16 bf16 (as 16-bit lanes) -> 16 float32 (exact: bf16 is the top half of a float32)
static inline __m512 widen_bf16(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// How a block multiplies: F32Panel reads float32 panels [K, 32] and broadcasts one x value per step; Bf16Panel
// reads bf16 panels [K/2, 32, 2] and broadcasts a pair of x values, whose products with a pair from each of 16
// columns vdpbf16ps adds into float32 lanes.
struct F32Panel {
    using T = float;
    static constexpr int64_t kStep = 1;  // K positions per panel row
    using XVec = __m512;
    using WVec = __m512;
    static inline XVec x(const float* a) { return _mm512_set1_ps(*a); }
    static inline WVec w(const float* p) { return _mm512_loadu_ps(p); }
    static inline __m512 dot(__m512 acc, XVec x, WVec w) { return _mm512_fmadd_ps(x, w, acc); }
    static inline __m512 widen(const float* p) { return _mm512_loadu_ps(p); }
    static inline __m512 round(__m512 v) { return v; }  // to T's precision
    static inline void store(float* c, __m512 lo, __m512 hi, int64_t ncols) {
        const ColumnMasks keep(ncols);
        _mm512_mask_storeu_ps(c, keep.lo, lo);
        _mm512_mask_storeu_ps(c + 16, keep.hi, hi);
    }
    static inline void load(const float* c, int64_t ncols, __m512& lo, __m512& hi) {  // store's inverse
        const ColumnMasks keep(ncols);
        lo = _mm512_maskz_loadu_ps(keep.lo, c);
        hi = _mm512_maskz_loadu_ps(keep.hi, c + 16);
    }
};

#if defined(__AVX512BF16__)
struct Bf16Panel {
    using T = bf16;
    static constexpr int64_t kStep = 2;
    using XVec = __m512bh;
    using WVec = __m512bh;
    static inline XVec x(const bf16* a) { return (__m512bh)_mm512_set1_epi32(*(const int32_t*)a); }
    static inline WVec w(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
    static inline __m512 dot(__m512 acc, XVec x, WVec w) { return _mm512_dpbf16_ps(acc, x, w); }
    static inline __m512 widen(const bf16* p) { return widen_bf16(_mm256_loadu_si256((const __m256i*)p)); }
    static inline __m512 round(__m512 v) {  // to bf16 (nearest even) and back
        return widen_bf16((__m256i)_mm512_cvtneps_pbh(v));
    }
    static inline void store(bf16* c, __m512 lo, __m512 hi, int64_t ncols) {
        const __mmask32 keep = ncols >= kPanel ? 0xffffffffu : (1u << ncols) - 1;
        _mm512_mask_storeu_epi16(c, keep, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    static inline void load(const bf16* c, int64_t ncols, __m512& lo, __m512& hi) {  // store's inverse
        const __mmask32 keep = ncols >= kPanel ? 0xffffffffu : (1u << ncols) - 1;
        const __m512i v = _mm512_maskz_loadu_epi16(keep, c);
        lo = widen_bf16(_mm512_castsi512_si256(v));
        hi = widen_bf16(_mm512_extracti64x4_epi64(v, 1));
    }
};
#endif

// exp(x) to about an ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial, times 2^n by
// vscalefps (which gives inf past the float range and 0 below it)
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts: n * ln2 exact enough
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 silu(__m512 g) {  // g / (1 + exp(-g)), torch's formula
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

// SiLU of rows [rows, ncols] of c in place, just stored (rounded to T) by a block, still in L1: a pass of its own,
// so that exp's constants never take registers from a block's accumulators (in the block's epilogue they halved
// its speed)
template <typename P>
__attribute__((noinline)) static void silu_rows(typename P::T* c, int64_t ldc, int64_t rows, int64_t ncols) {
    for (int64_t r = 0; r < rows; ++r) {
        __m512 lo, hi;
        P::load(c + r * ldc, ncols, lo, hi);
        P::store(c + r * ldc, silu(lo), silu(hi), ncols);
    }
}

// Walks the next panels' cache lines, one prefetch per call, while a row block that reads its panel from cache
// runs: the memory bus would otherwise idle until the next panel's first row block misses on every line.
struct NextPanels {
    const char* region[2] = {nullptr, nullptr};  // the next panel (and, fused, the next up panel)
    int64_t lines = 0;    // cache lines per region
    int64_t issued = 0;   // lines issued so far, over both regions
    inline void step() {
        if (issued < 2 * lines && region[issued & 1]) {
            _mm_prefetch(region[issued & 1] + (issued >> 1) * 64, _MM_HINT_T0);
        }
        ++issued;
    }
};

// sums[R rows, 32 columns] = a[R, K] (rows lda apart) . panel (+ bias[32]) (with kAdd, + add[R, 32], rows ldadd
// apart), then the epilogue E; `gate` holds the R x 32 gate values between a kGate block and its kSiluMul block;
// `ncols` < 32 only in the last panel of an N that is not a multiple of 32
template <typename P, int R, int E, bool kAdd = false>
static inline void block(const typename P::T* a, int64_t lda, const typename P::T* panel, int64_t K,
                         const typename P::T* bias, typename P::T* c, int64_t ldc, int64_t ncols, float* gate,
                         NextPanels* pf = nullptr, const float* add = nullptr, int64_t ldadd = 0) {
    __m512 lo[R], hi[R];  // columns 0-15 and 16-31 of each row
    for (int r = 0; r < R; ++r) {
        lo[r] = _mm512_setzero_ps();
        hi[r] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < K; k += P::kStep) {  // one panel row (kStep K positions) per step
        if (pf) pf->step();
        const typename P::WVec w_lo = P::w(panel + k * kPanel);
        const typename P::WVec w_hi = P::w(panel + k * kPanel + 16 * P::kStep);
        for (int r = 0; r < R; ++r) {
            const typename P::XVec x = P::x(a + r * lda + k);
            lo[r] = P::dot(lo[r], x, w_lo);
            hi[r] = P::dot(hi[r], x, w_hi);
        }
    }
    const __m512 b_lo = bias ? P::widen(bias) : _mm512_setzero_ps();
    const __m512 b_hi = bias ? P::widen(bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
        __m512 v_lo = _mm512_add_ps(lo[r], b_lo), v_hi = _mm512_add_ps(hi[r], b_hi);
        if constexpr (kAdd) {
            v_lo = _mm512_add_ps(v_lo, _mm512_loadu_ps(add + r * ldadd));
            v_hi = _mm512_add_ps(v_hi, _mm512_loadu_ps(add + r * ldadd + 16));
        }
        if constexpr (E == kGate) {
            _mm512_storeu_ps(gate + r * kPanel, P::round(v_lo));
            _mm512_storeu_ps(gate + r * kPanel + 16, P::round(v_hi));
            continue;
        }
        if constexpr (E == kSiluMul) {  // silu rounded to T, times up rounded to T, as two elementwise ops would
            v_lo = _mm512_mul_ps(P::round(silu(_mm512_loadu_ps(gate + r * kPanel))), P::round(v_lo));
            v_hi = _mm512_mul_ps(P::round(silu(_mm512_loadu_ps(gate + r * kPanel + 16))), P::round(v_hi));
        }
        P::store(c + r * ldc, v_lo, v_hi, ncols);
    }
}

// Rows [m0, m1) in register blocks: run(std::integral_constant<int, R>, m) for blocks of kRows, then the rest
template <typename Run>
static inline void for_row_blocks(int64_t m0, int64_t m1, Run&& run) {
    int64_t m = m0;
    for (; m + kRows <= m1; m += kRows) run(std::integral_constant<int, kRows>(), m);
    switch (m1 - m) {
        case 1: run(std::integral_constant<int, 1>(), m); break;
        case 2: run(std::integral_constant<int, 2>(), m); break;
        case 3: run(std::integral_constant<int, 3>(), m); break;
        case 4: run(std::integral_constant<int, 4>(), m); break;
        case 5: run(std::integral_constant<int, 5>(), m); break;
        case 6: run(std::integral_constant<int, 6>(), m); break;
        case 7: run(std::integral_constant<int, 7>(), m); break;
        default: break;
    }
}

// Rows [m0, m1) against output panel p, in blocks of kRows and then the rest. With SiLU, output panel p is gate
// panel p and up panel p + N / 32 of the packed [2N/32, ...] matrix; with kAdd, add [M, 2N] joins their sums.
// kAct (without kSilu): SiLU of each output (`silu_rows` over each block once stored).
template <typename P, bool kSilu, bool kAdd, bool kAct>
static void rows_by_panel(const typename P::T* a, int64_t lda, const typename P::T* packed, const typename P::T* bias,
                          typename P::T* c, int64_t ldc, int64_t m0, int64_t m1, int64_t p, int64_t N, int64_t K,
                          bool prefetch_next, const float* add, int64_t ldadd) {
    using T = typename P::T;
    const int64_t panel_size = K * kPanel, up = (N + kPanel - 1) / kPanel;  // elements per panel; up's first panel
    float gate[kRows * kPanel];
    NextPanels next;
    if (prefetch_next) {
        next.region[0] = reinterpret_cast<const char*>(packed + (p + 1) * panel_size);
        if (kSilu) next.region[1] = reinterpret_cast<const char*>(packed + (up + p + 1) * panel_size);
        next.lines = panel_size * static_cast<int64_t>(sizeof(T)) / 64;
    }
    NextPanels* pf = nullptr;  // the first row block streams its own panel; the others fetch the next one
    auto run = [&](auto rows, int64_t m) {
        constexpr int R = decltype(rows)::value;
        const T* am = a + m * lda;
        T* cm = c + m * ldc + p * kPanel;
        const int64_t ncols = std::min<int64_t>(kPanel, N - p * kPanel);
        if constexpr (kSilu) {
            const T* gate_bias = bias ? bias + p * kPanel : nullptr;
            const T* up_bias = bias ? bias + N + p * kPanel : nullptr;
            const float* ap = kAdd ? add + m * ldadd + p * kPanel : nullptr;  // gate's addend; up's: + N
            block<P, R, kGate, kAdd>(am, lda, packed + p * panel_size, K, gate_bias, cm, ldc, ncols, gate, pf, ap,
                                     ldadd);
            block<P, R, kSiluMul, kAdd>(am, lda, packed + (up + p) * panel_size, K, up_bias, cm, ldc, ncols, gate, pf,
                                        kAdd ? ap + N : nullptr, ldadd);
        } else {
            block<P, R, kStore>(am, lda, packed + p * panel_size, K, bias ? bias + p * kPanel : nullptr, cm, ldc, ncols,
                                gate, pf);
            if constexpr (kAct) silu_rows<P>(cm, ldc, R, ncols);
        }
        if (prefetch_next) pf = &next;
    };
    for_row_blocks(m0, m1, run);
}

constexpr int64_t kKBlock = 256;        // float32 K positions a pass over a chunk of rows reads before the next panel
constexpr int64_t kKBlockRows = 256;    // rows of such a chunk: each panel block read from memory serves them all
constexpr int64_t kKBlockMinRows = 128; // fewer rows (decode) take the unblocked walk, which prefetches the next panel
constexpr int64_t kKBlockMinK = 4096;   // shorter K: a chunk's rows of x fit in L2 whole (blocking lost 5-15% there)

// float32 sums[R rows, 32 columns] += a . panel rows [kb, 32], for one block of K, `a` copied k-major ([kb, R]: the
// R values a step broadcasts share a cache line): the sums start from c's
// (the earlier K blocks' partial sums, exact in float32, so the order of the additions is the unblocked one's) or
// zero for the first block, and the last block adds the bias; `ncols` < 32 only in the last panel
template <int R>
static inline void f32_kblock(const float* a, const float* panel, int64_t kb, float* c, int64_t ldc,
                              int64_t ncols, bool first, const float* bias_or_null_unless_last) {
    const ColumnMasks keep(ncols);
    __m512 lo[R], hi[R];
    UNROLL for (int r = 0; r < R; ++r) {
        lo[r] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(keep.lo, c + r * ldc);
        hi[r] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(keep.hi, c + r * ldc + 16);
    }
    for (int64_t k = 0; k < kb; ++k) {
        const __m512 w_lo = _mm512_loadu_ps(panel + k * kPanel);
        const __m512 w_hi = _mm512_loadu_ps(panel + k * kPanel + 16);
        UNROLL for (int r = 0; r < R; ++r) {
            const __m512 x = _mm512_set1_ps(a[k * R + r]);
            lo[r] = _mm512_fmadd_ps(x, w_lo, lo[r]);
            hi[r] = _mm512_fmadd_ps(x, w_hi, hi[r]);
        }
    }
    const float* bias = bias_or_null_unless_last;
    const __m512 b_lo = bias ? _mm512_maskz_loadu_ps(keep.lo, bias) : _mm512_setzero_ps();
    const __m512 b_hi = bias ? _mm512_maskz_loadu_ps(keep.hi, bias + 16) : _mm512_setzero_ps();
    UNROLL for (int r = 0; r < R; ++r) {
        _mm512_mask_storeu_ps(c + r * ldc, keep.lo, _mm512_add_ps(lo[r], b_lo));
        _mm512_mask_storeu_ps(c + r * ldc + 16, keep.hi, _mm512_add_ps(hi[r], b_hi));
    }
}

// The float32 linear for long K (a down projection, a tower's fc2): per chunk of rows, K in blocks of kKBlock, each
// block against this thread's panels, so the chunk's block of `a` and a panel's block stay in cache; the partial
// sums wait in c. Same results as the unblocked walk.
static void f32_linear_kblocked(const float* A, int64_t lda, const float* W, const float* B, float* C, int64_t ldc,
                                int64_t M, int64_t N, int64_t K, int64_t p0, int64_t p1) {
    std::vector<float> copy(kKBlockRows * kKBlock);  // the chunk's block of `a`, k-major per block of rows
    for (int64_t m0 = 0; m0 < M; m0 += kKBlockRows) {
        const int64_t m1 = std::min(M, m0 + kKBlockRows);
        for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
            const int64_t kb = std::min(kKBlock, K - k0);
            const bool first = k0 == 0, last = k0 + kb >= K;
            for (int64_t m = m0; m < m1; m += kRows) {  // rows [m, m + R) -> copy[(m - m0) * kb ...] as [kb, R]
                const int64_t R = std::min(kRows, m1 - m);
                float* dst = copy.data() + (m - m0) * kb;
                for (int64_t r = 0; r < R; ++r) {
                    const float* src = A + (m + r) * lda + k0;
                    for (int64_t k = 0; k < kb; ++k) dst[k * R + r] = src[k];
                }
            }
            for (int64_t p = p0; p < p1; ++p) {
                const float* panel = W + p * K * kPanel + k0 * kPanel;
                const int64_t ncols = std::min<int64_t>(kPanel, N - p * kPanel);
                const float* bias = last && B ? B + p * kPanel : nullptr;
                auto run = [&](auto rows, int64_t m) {
                    constexpr int R = decltype(rows)::value;
                    f32_kblock<R>(copy.data() + (m - m0) * kb, panel, kb, C + m * ldc + p * kPanel, ldc, ncols, first,
                                  bias);
                };
                for_row_blocks(m0, m1, run);
            }
        }
    }
}

template <typename P, bool kSilu, bool kAdd, bool kAct = false>
static void linear(const void* a, int64_t lda, const void* packed, const void* bias, void* c, int64_t ldc, int64_t M,
                   int64_t N, int64_t K, int64_t threads, const float* add, int64_t ldadd) {
    using T = typename P::T;
    const T* A = (const T*)a;
    const T* W = (const T*)packed;
    const T* B = (const T*)bias;
    T* C = (T*)c;
    const int64_t panels = (N + kPanel - 1) / kPanel;
    constexpr int64_t rows_a_chunk = std::is_same_v<P, F32Panel> ? kF32RowChunk : kRowChunk;
    const int64_t chunks = (M + rows_a_chunk - 1) / rows_a_chunk;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        if (panels >= nt) {  // each thread its contiguous range of panels, for every chunk of rows
            const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
            bool blocked = false;
            if constexpr (std::is_same_v<P, F32Panel> && !kSilu && !kAdd && !kAct) {
                blocked = K >= kKBlockMinK && M >= kKBlockMinRows;
                if (blocked) f32_linear_kblocked(A, lda, W, B, C, ldc, M, N, K, p0, p1);
            }
            for (int64_t ch = 0; ch < (blocked ? 0 : chunks); ++ch)
                for (int64_t p = p0; p < p1; ++p)
                    rows_by_panel<P, kSilu, kAdd, kAct>(A, lda, W, B, C, ldc, ch * rows_a_chunk,
                                                  std::min(M, (ch + 1) * rows_a_chunk), p, N, K, p + 1 < p1, add,
                                                  ldadd);
        } else {  // fewer panels than threads: split the rows instead
            const int64_t m0 = M * t / nt, m1 = M * (t + 1) / nt;
            for (int64_t p = 0; p < panels; ++p)
                if (m1 > m0) rows_by_panel<P, kSilu, kAdd, kAct>(A, lda, W, B, C, ldc, m0, m1, p, N, K, false, add, ldadd);
        }
    }
}

}  // namespace avx512
