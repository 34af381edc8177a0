// The packed bf16 linear on AMX tiles, included by cpu_linear.cpp after cpu_linear_avx512.cpp (its Bf16Panel
// epilogue helpers and silu) where the source is built for AVX-512 with AMX-BF16. The packed layout [N/32, K/2, 32,
// 2] is already what tdpbf16ps reads as B: 16 K pairs of a panel, columns 0-15 (or 16-31), are 16 rows of 64 bytes
// 128 bytes apart. x is copied into whole A tiles (16 rows of 32 K, zero past M), then every 32-row block of it
// meets each panel a tile step (32 K) at a time, float32 sums. Used for K a multiple of 32 (the caller checks
// `serves`); SiLU(gate) * up, and its float32 addend, as the register path computes them.
#include "amx_tiles.h"

namespace amx {

constexpr int64_t kTileK = 32;  // K positions of one tile step (16 bf16 pairs)

static bool serves(int64_t K) { return K % kTileK == 0 && amx_tiles::permitted(); }

// c [M, N] = a [M, K] . W^T + bias (kSilu: W is gate_up [2N/32 panels], c = SiLU(gate) * up; kAdd: add [M, 2N]
// float32, rows ldadd apart, joins the gate and up sums after the bias; kAct: c = SiLU of the sums rounded to bf16),
// bf16 in and out
template <bool kSilu, bool kAdd = false, bool kAct = false>
static void linear(const void* a, int64_t lda, const void* packed, const void* bias, void* c, int64_t ldc, int64_t M,
                   int64_t N, int64_t K, int64_t threads, const float* add, int64_t ldadd) {
    using P = avx512::Bf16Panel;
    const bf16* A = (const bf16*)a;
    const bf16* W = (const bf16*)packed;
    const bf16* B = (const bf16*)bias;
    bf16* C = (bf16*)c;
    const int64_t Mp = (M + 15) / 16 * 16, panels = (N + kPanel - 1) / kPanel, panel_size = K * kPanel;
    // x as A tiles [Mp / 16, K / 32, 16 rows, 32 K], zero past M: each tile 1 KB in one piece
    static thread_local std::vector<bf16> xt;
    xt.resize(Mp * K);  // every element written once below: x's rows copied, the pad rows zeroed
    bf16* const X = xt.data();  // (thread_local: the workers take the pointer)
    for (int64_t m = 0; m < Mp; ++m) {
        bf16* dst = X + (m / 16) * 16 * K + (m % 16) * kTileK;
        for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
            if (m < M) std::memcpy(dst + k0 * 16, A + m * lda + k0, kTileK * sizeof(bf16));
            else std::memset(dst + k0 * 16, 0, kTileK * sizeof(bf16));
        }
    }
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        if (p0 < p1) {
            amx_tiles::configure();
            alignas(64) float sums[32 * kPanel], up_sums[32 * kPanel];
            for (int64_t p = p0; p < p1; ++p) {
                const int64_t ncols = std::min<int64_t>(kPanel, N - p * kPanel);
                bf16 padded[kPanel] = {};  // the bias of a ragged last panel, zero-padded
                const bf16* pb = B ? B + p * kPanel : nullptr;
                if (pb && ncols < kPanel) {
                    std::copy(pb, pb + ncols, padded);
                    pb = padded;
                }
                const __m512 b_lo = pb ? P::widen(pb) : _mm512_setzero_ps();
                const __m512 b_hi = pb ? P::widen(pb + 16) : _mm512_setzero_ps();
                __m512 u_lo = _mm512_setzero_ps(), u_hi = _mm512_setzero_ps();  // up's bias (kSilu)
                if (kSilu && B) {
                    u_lo = P::widen(B + N + p * kPanel);
                    u_hi = P::widen(B + N + p * kPanel + 16);
                }
                for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
                    const bool two = m0 + 16 < Mp;  // a second 16-row block
                    // A tiles 1 KB a step; B tiles 16 pair rows of the packed panel, 128 bytes apart
                    auto sums_of = [&](int64_t panel, float* out) {
                        amx_tiles::panel_sums<amx_tiles::Bf16Dot>(X + m0 * K, 1024, 32 * K, W + panel * panel_size,
                                                                  2048, 64, 128, K / kTileK, two, out);
                    };
                    sums_of(p, sums);
                    if (kSilu) sums_of(panels + p, up_sums);
                    for (int64_t r = 0; r < std::min<int64_t>(32, M - m0); ++r) {
                        __m512 v_lo = _mm512_add_ps(_mm512_loadu_ps(sums + r * kPanel), b_lo);
                        __m512 v_hi = _mm512_add_ps(_mm512_loadu_ps(sums + r * kPanel + 16), b_hi);
                        const float* ar = kAdd ? add + (m0 + r) * ldadd + p * kPanel : nullptr;  // gate's; up's + N
                        if (kAdd) {
                            v_lo = _mm512_add_ps(v_lo, _mm512_loadu_ps(ar));
                            v_hi = _mm512_add_ps(v_hi, _mm512_loadu_ps(ar + 16));
                        }
                        if (kSilu) {  // silu of gate rounded to bf16, rounded, times up rounded, as the ops would
                            const __m512 g_lo = v_lo, g_hi = v_hi;
                            v_lo = _mm512_add_ps(_mm512_loadu_ps(up_sums + r * kPanel), u_lo);
                            v_hi = _mm512_add_ps(_mm512_loadu_ps(up_sums + r * kPanel + 16), u_hi);
                            if (kAdd) {
                                v_lo = _mm512_add_ps(v_lo, _mm512_loadu_ps(ar + N));
                                v_hi = _mm512_add_ps(v_hi, _mm512_loadu_ps(ar + N + 16));
                            }
                            v_lo = _mm512_mul_ps(P::round(avx512::silu(P::round(g_lo))), P::round(v_lo));
                            v_hi = _mm512_mul_ps(P::round(avx512::silu(P::round(g_hi))), P::round(v_hi));
                        }
                        if (kAct) {
                            v_lo = avx512::silu(P::round(v_lo));
                            v_hi = avx512::silu(P::round(v_hi));
                        }
                        P::store(C + (m0 + r) * ldc + p * kPanel, v_lo, v_hi, ncols);
                    }
                }
            }
            _tile_release();
        }
    }
}

}  // namespace amx
