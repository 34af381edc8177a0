// bf16 linear on packed weights for CPUs with AVX512-BF16 (see vlserve/kernels/cpu_linear.py).
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <omp.h>

#define BF16_TARGET __attribute__((target("avx512f,avx512bf16,avx512vl,avx512bw,avx512dq")))
typedef uint16_t bf16;
constexpr int64_t kPanel = 32;     // output columns per packed panel (two float32 vectors)
constexpr int64_t kRows = 8;       // rows of the register block
constexpr int64_t kRowChunk = 64;  // rows whose products with a panel are computed before the next panel

// 16 bf16 -> 16 float32 (exact: bf16 is the top half of a float32)
BF16_TARGET static inline __m512 widen(const bf16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// c[R rows, up to 32 columns] = a[R, K] (rows lda apart) . panel[K/2, 32, 2] (+ bias[32]); `ncols` < 32 only in the
// last panel of an N that is not a multiple of 32
template <int R>
BF16_TARGET static inline void block(const bf16* a, int64_t lda, const bf16* panel, int64_t K2, const bf16* bias,
                                     bf16* c, int64_t ldc, int64_t ncols) {
    __m512 lo[R], hi[R];  // columns 0-15 and 16-31 of each row
    for (int r = 0; r < R; ++r) {
        lo[r] = _mm512_setzero_ps();
        hi[r] = _mm512_setzero_ps();
    }
    for (int64_t kk = 0; kk < K2; ++kk) {  // one pair of K positions per step
        const __m512bh w_lo = (__m512bh)_mm512_loadu_si512(panel + kk * 2 * kPanel);
        const __m512bh w_hi = (__m512bh)_mm512_loadu_si512(panel + kk * 2 * kPanel + kPanel);
        for (int r = 0; r < R; ++r) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32(*(const int32_t*)(a + r * lda + 2 * kk));
            lo[r] = _mm512_dpbf16_ps(lo[r], x, w_lo);
            hi[r] = _mm512_dpbf16_ps(hi[r], x, w_hi);
        }
    }
    const __m512 b_lo = bias ? widen(bias) : _mm512_setzero_ps();
    const __m512 b_hi = bias ? widen(bias + 16) : _mm512_setzero_ps();
    const __mmask32 keep = ncols >= kPanel ? 0xffffffffu : ((1u << ncols) - 1);
    for (int r = 0; r < R; ++r) {  // round to bf16 (nearest even) once
        const __m512bh out = _mm512_cvtne2ps_pbh(_mm512_add_ps(hi[r], b_hi), _mm512_add_ps(lo[r], b_lo));
        _mm512_mask_storeu_epi16(c + r * ldc, keep, (__m512i)out);
    }
}

// rows [m0, m1) of c against panel p: blocks of kRows, then the rest
BF16_TARGET static void rows_by_panel(const bf16* a, int64_t lda, const bf16* packed, const bf16* bias, bf16* c,
                                      int64_t ldc, int64_t m0, int64_t m1, int64_t p, int64_t N, int64_t K2) {
    const bf16* panel = packed + p * K2 * 2 * kPanel;
    const bf16* pb = bias ? bias + p * kPanel : nullptr;
    const int64_t ncols = std::min<int64_t>(kPanel, N - p * kPanel);
    int64_t m = m0;
    for (; m + kRows <= m1; m += kRows) block<kRows>(a + m * lda, lda, panel, K2, pb, c + m * ldc + p * kPanel, ldc, ncols);
    const bf16* am = a + m * lda;
    bf16* cm = c + m * ldc + p * kPanel;
    switch (m1 - m) {
        case 1: block<1>(am, lda, panel, K2, pb, cm, ldc, ncols); break;
        case 2: block<2>(am, lda, panel, K2, pb, cm, ldc, ncols); break;
        case 3: block<3>(am, lda, panel, K2, pb, cm, ldc, ncols); break;
        case 4: block<4>(am, lda, panel, K2, pb, cm, ldc, ncols); break;
        case 5: block<5>(am, lda, panel, K2, pb, cm, ldc, ncols); break;
        case 6: block<6>(am, lda, panel, K2, pb, cm, ldc, ncols); break;
        case 7: block<7>(am, lda, panel, K2, pb, cm, ldc, ncols); break;
        default: break;
    }
}

// a: [M, K] bf16 (rows lda apart); packed: [ceil(N/32), K/2, 32, 2]; bias: [N] or unused; c: [M, N] (rows ldc apart)
extern "C" BF16_TARGET void kernel(const void* a, int64_t lda, const void* packed, const void* bias, int64_t has_bias,
                                   void* c, int64_t ldc, int64_t M, int64_t N, int64_t K, int64_t threads) {
    const bf16* A = (const bf16*)a;
    const bf16* W = (const bf16*)packed;
    const bf16* B = has_bias ? (const bf16*)bias : nullptr;
    bf16* C = (bf16*)c;
    const int64_t panels = (N + kPanel - 1) / kPanel, K2 = K / 2;
    const int64_t chunks = (M + kRowChunk - 1) / kRowChunk;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        if (panels >= T) {  // each thread its contiguous range of panels, for every chunk of rows
            const int64_t p0 = panels * t / T, p1 = panels * (t + 1) / T;
            for (int64_t ch = 0; ch < chunks; ++ch)
                for (int64_t p = p0; p < p1; ++p)
                    rows_by_panel(A, lda, W, B, C, ldc, ch * kRowChunk, std::min(M, (ch + 1) * kRowChunk), p, N, K2);
        } else {  // fewer panels than threads: split the rows instead
            const int64_t m0 = M * t / T, m1 = M * (t + 1) / T;
            for (int64_t p = 0; p < panels; ++p)
                if (m1 > m0) rows_by_panel(A, lda, W, B, C, ldc, m0, m1, p, N, K2);
        }
    }
}
