// WNA16 and FP8 on AVX2 + FMA (8-lane ymm registers), included by quant_linear.cpp after cpu_linear_avx2.cpp, whose
// float32 register blocks (avx2::tile / avx2::tail over [K, 32] float32 panels), work split and bf16 conversions
// they reuse. Packed layouts (quant_linear_cpu.py builds them), in panels of 32 output columns (zero-padded), K
// padded to Kp, a multiple of 8:
// - WNA16: uint32 lanes [N/32, Kp/E, 32]: lane c of panel row l holds column c's E = 32/bits values at K positions
//   l*E .. l*E+E-1, value j in bits [bits*j, bits*j+bits); scales [N/32, G, 32] (float32, float16 or bf16 as the
//   checkpoint stored them) and zeros uint8 [N/32, G, 32], G groups of `group` K positions.
// - FP8: the same with E = 4 e4m3 bytes a lane; scales float32 [N/32, G, 32] (block scales expanded per column).
namespace quant {

constexpr int64_t kDepthK = 128;   // K positions of a panel dequantized at a time: a 16 KB float32 scratch in L1
constexpr int64_t kFusedRows = 2;  // up to this many rows the weights are dequantized in registers, once for all
constexpr int64_t kChunk = avx2::kChunkBlocks * avx2::F32::kRows;  // rows a thread takes through its panels at once
constexpr int64_t kBlock = avx2::F32::kRows;  // rows of a float32 register block (6)

struct Call {  // one call's operands (see `kernel` in quant_linear.cpp)
    const void* x;
    int64_t ldx;
    const void* w;
    const void* scales;
    const void* zeros;
    const float* bias;
    void* out;
    int64_t ldo, M, N, K, group, threads;
    bool bf16;
    int scale_dtype;
    int act;  // FP8: how x is rounded through e4m3 first (kAct*), act_group columns a group, act_scale if static
    int64_t act_group;
    float act_scale;
    const void* x_row(int64_t m) const { return (const char*)x + m * ldx * (bf16 ? 2 : 4); }
};

enum Act { kActNone = 0, kActToken = 1, kActGroup = 2, kActStatic = 3 };

// 8 scales of consecutive columns, from float32, float16 or bf16, as float32 (exact)
static inline __m256 load_scales(const void* base, int64_t at, int dtype) {
    if (dtype == 1) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)base + at)));
    if (dtype == 2) return avx2::widen8((const bf16*)base + at);
    return _mm256_loadu_ps((const float*)base + at);
}

// How a family dequantizes: E K positions per 32-bit lane; `group` loads the scale (and zero) of 8 columns at
// element `at` of the [N/32, G, 32] group arrays; `value(lane, j, g)` is value j of each of the 8 lanes as float32,
// rounded once, as the float32 reference computes it.
template <int kBits>
struct IntW {  // w = (q - z) * s
    static constexpr int E = 32 / kBits;
    static constexpr int kPrescale = kBits;  // fused_int reads x scaled (see there)
    struct Group {
        __m256 s, z;
    };
    static inline Group group(const Call& c, int64_t at) {
        const __m128i z8 = _mm_loadl_epi64((const __m128i*)((const uint8_t*)c.zeros + at));
        return {load_scales(c.scales, at, c.scale_dtype), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(z8))};
    }
    static inline __m256 value(__m256i lane, int j, const Group& g) {
        const __m256i q = _mm256_and_si256(_mm256_srli_epi32(lane, kBits * j), _mm256_set1_epi32((1 << kBits) - 1));
        return _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(q), g.z), g.s);
    }
};

struct Fp8W {  // w = e4m3 value * s
    static constexpr int E = 4;
    static constexpr int kPrescale = 0;
    struct Group {
        __m256 s;  // times 2^120: see value
    };
    static inline Group group(const Call& c, int64_t at) {
        return {_mm256_mul_ps(_mm256_loadu_ps((const float*)c.scales + at), _mm256_set1_ps(0x1p120f))};
    }
    // Byte j moved to the top of the lane, shifted right 4 (arithmetic) and masked keeps its sign at bit 31 and its
    // exponent and mantissa at bits 20-26: a float32 of the e4m3 value times 2^-120 (its subnormals included), so
    // one multiply by s * 2^120 gives the value times s, rounded once. NaN bytes (0x7f, 0xff) read as 480.
    static inline __m256 value(__m256i lane, int j, const Group& g) {
        const __m256i top = j == 3 ? lane : _mm256_slli_epi32(lane, 24 - 8 * j);
        const __m256i bits = _mm256_and_si256(_mm256_srai_epi32(top, 4), _mm256_set1_epi32(int32_t(0x87f00000u)));
        return _mm256_mul_ps(_mm256_castsi256_ps(bits), g.s);
    }
};

// wf [(l1 - l0) * E, 32] = a panel's weights at panel rows [l0, l1) (K positions l0*E ..), dequantized
template <typename D>
static void dequant_block(const Call& c, const uint32_t* lanes, int64_t group_base, int64_t l0, int64_t l1,
                          float* wf) {
    const int64_t per_group = c.group / D::E;  // panel rows per group
    for (int64_t l = l0; l < l1;) {
        const int64_t g = l / per_group, end = std::min(l1, (g + 1) * per_group);
        typename D::Group grp[4];
        UNROLL for (int v = 0; v < 4; ++v) grp[v] = D::group(c, group_base + g * kPanel + 8 * v);
        for (; l < end; ++l) {
            float* row = wf + (l - l0) * D::E * kPanel;
            UNROLL for (int v = 0; v < 4; ++v) {
                const __m256i q = _mm256_loadu_si256((const __m256i*)(lanes + l * kPanel + 8 * v));
                UNROLL for (int j = 0; j < D::E; ++j)
                    _mm256_storeu_ps(row + j * kPanel + 8 * v, D::value(q, j, grp[v]));
            }
        }
    }
}

// sums [R, 32] = x [R, Kp] (rows ldx apart) . a panel, each weight dequantized in registers once for the R rows
template <typename D, int R>
__attribute__((noinline)) static void fused(const Call& c, const uint32_t* lanes, int64_t group_base, int64_t Kp,
                                            const float* x, int64_t ldx, float* sums) {
    __m256 acc[R][4];
    UNROLL for (int r = 0; r < R; ++r) UNROLL for (int v = 0; v < 4; ++v) acc[r][v] = avx2::zero();
    const int64_t per_group = c.group / D::E, rows = Kp / D::E;
    for (int64_t l = 0; l < rows;) {
        const int64_t g = l / per_group, end = std::min(rows, (g + 1) * per_group);
        typename D::Group grp[4];
        UNROLL for (int v = 0; v < 4; ++v) grp[v] = D::group(c, group_base + g * kPanel + 8 * v);
        for (; l < end; ++l) {
            const float* xl = x + l * D::E;
            UNROLL for (int v = 0; v < 4; ++v) {
                const __m256i q = _mm256_loadu_si256((const __m256i*)(lanes + l * kPanel + 8 * v));
                UNROLL for (int j = 0; j < D::E; ++j) {
                    const __m256 w = D::value(q, j, grp[v]);
                    UNROLL for (int r = 0; r < R; ++r)
                        acc[r][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(xl + r * ldx + j), w, acc[r][v]);
                }
            }
        }
    }
    UNROLL for (int r = 0; r < R; ++r) UNROLL for (int v = 0; v < 4; ++v) _mm256_storeu_ps(sums + r * kPanel + 8 * v,
                                                                                          acc[r][v]);
}

// The same for B-bit integer weights with fewer instructions per weight (decode is bound by them, not by memory):
// value j of a lane is masked in place (the low 16 bits hold H = 16 / B values, the high 16 bits, shifted down once,
// the others), so it reads as q * 2^(B i), i = j mod H; the group's zero is subtracted at that scale and x was
// scaled by 2^-(B i) (`prescale`), so each FMA adds x * (q - z) exactly as unscaled (|x| above 2^-114, where the
// scaled x stays a normal float); the group's sums are multiplied by its scale at its end. Per 8 weights: and,
// convert, subtract, FMA. The panel is walked as two 16-column halves (a panel row's two cache lines), j outermost:
// 2 lanes, their high halves and 2-4 accumulators per row stay in registers (one row keeps two accumulators per
// column vector, for even and odd j, so 4 FMA chains are in flight).
// `next` (the next panel's lanes, or null) is fetched one cache line per panel row as this one is walked: decode
// reads every panel once, from memory, and the two strided halves alone left the prefetchers behind (a 4-bit 9728 x
// 896 matrix at one row ran 3.1 GB/s from L3 without, against 21 for the bf16 kernel).
template <int B, int R>
__attribute__((noinline)) static void fused_int(const Call& c, const uint32_t* lanes, int64_t group_base, int64_t Kp,
                                                const float* x, int64_t ldx, float* sums, const uint32_t* next) {
    constexpr int E = 32 / B, H = E / 2, P = R == 1 ? 2 : 1;
    const int64_t per_group = c.group / E, rows = Kp / E;
    for (int half = 0; half < 2; ++half) {
        for (int64_t l = 0; l < rows;) {
            const int64_t g = l / per_group, end = std::min(rows, (g + 1) * per_group);
            const bool first = l == 0;
            __m256 s[2], zs[2][H];  // the group's scales, and zeros times 2^(B i)
            UNROLL for (int v = 0; v < 2; ++v) {
                const typename IntW<B>::Group grp = IntW<B>::group(c, group_base + g * kPanel + 16 * half + 8 * v);
                s[v] = grp.s;
                UNROLL for (int i = 0; i < H; ++i) zs[v][i] = _mm256_mul_ps(grp.z, _mm256_set1_ps(float(1 << (B * i))));
            }
            __m256 acc[R][2][P];
            UNROLL for (int r = 0; r < R; ++r) UNROLL for (int v = 0; v < 2; ++v) UNROLL for (int p = 0; p < P; ++p)
                acc[r][v][p] = avx2::zero();
            for (; l < end; ++l) {
                if (next) _mm_prefetch((const char*)next + (half * rows + l) * 64, _MM_HINT_T0);
                const float* xl = x + l * E;
                __m256i q[2], high[2];
                UNROLL for (int v = 0; v < 2; ++v) {
                    q[v] = _mm256_loadu_si256((const __m256i*)(lanes + l * kPanel + 16 * half + 8 * v));
                    high[v] = _mm256_srli_epi32(q[v], 16);
                }
                UNROLL for (int j = 0; j < E; ++j) {
                    const __m256i mask = _mm256_set1_epi32(((1 << B) - 1) << (B * (j % H)));
                    UNROLL for (int v = 0; v < 2; ++v) {
                        const __m256i part = _mm256_and_si256(j < H ? q[v] : high[v], mask);
                        const __m256 w = _mm256_sub_ps(_mm256_cvtepi32_ps(part), zs[v][j % H]);
                        UNROLL for (int r = 0; r < R; ++r) {
                            __m256& a = acc[r][v][j % P];
                            a = _mm256_fmadd_ps(_mm256_broadcast_ss(xl + r * ldx + j), w, a);
                        }
                    }
                }
            }
            UNROLL for (int r = 0; r < R; ++r) UNROLL for (int v = 0; v < 2; ++v) {
                __m256 total = acc[r][v][0];
                UNROLL for (int p = 1; p < P; ++p) total = _mm256_add_ps(total, acc[r][v][p]);
                float* at = sums + r * kPanel + 16 * half + 8 * v;
                _mm256_storeu_ps(at, first ? _mm256_mul_ps(total, s[v])
                                           : _mm256_fmadd_ps(total, s[v], _mm256_loadu_ps(at)));
            }
        }
    }
}

#if defined(__AVX512F__) && !defined(VLSERVE_FORCE_AVX2)
constexpr bool kZmmDecode = true;
static inline __m512 join(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

// fused_int on 16-lane zmm registers (AVX-512 builds): a half panel is one register, so each and / convert /
// subtract / FMA covers 16 weights. The same operations per column in the same order: the same sums.
template <int B, int R>
__attribute__((noinline)) static void fused_int_zmm(const Call& c, const uint32_t* lanes, int64_t group_base,
                                                    int64_t Kp, const float* x, int64_t ldx, float* sums,
                                                    const uint32_t* next) {
    constexpr int E = 32 / B, H = E / 2, P = R == 1 ? 2 : 1;
    const int64_t per_group = c.group / E, rows = Kp / E;
    for (int half = 0; half < 2; ++half) {
        for (int64_t l = 0; l < rows;) {
            const int64_t g = l / per_group, end = std::min(rows, (g + 1) * per_group);
            const bool first = l == 0;
            const int64_t at = group_base + g * kPanel + 16 * half;
            const typename IntW<B>::Group lo = IntW<B>::group(c, at), hi = IntW<B>::group(c, at + 8);
            const __m512 s = join(lo.s, hi.s), z = join(lo.z, hi.z);
            __m512 zs[H];  // the group's zeros times 2^(B i)
            UNROLL for (int i = 0; i < H; ++i) zs[i] = _mm512_mul_ps(z, _mm512_set1_ps(float(1 << (B * i))));
            __m512 acc[R][P];
            UNROLL for (int r = 0; r < R; ++r) UNROLL for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
            for (; l < end; ++l) {
                if (next) _mm_prefetch((const char*)next + (half * rows + l) * 64, _MM_HINT_T0);
                const float* xl = x + l * E;
                const __m512i q = _mm512_loadu_si512(lanes + l * kPanel + 16 * half);
                const __m512i high = _mm512_srli_epi32(q, 16);
                UNROLL for (int j = 0; j < E; ++j) {
                    const __m512i part = _mm512_and_si512(j < H ? q : high,
                                                          _mm512_set1_epi32(((1 << B) - 1) << (B * (j % H))));
                    const __m512 w = _mm512_sub_ps(_mm512_cvtepi32_ps(part), zs[j % H]);
                    UNROLL for (int r = 0; r < R; ++r) {
                        __m512& a = acc[r][j % P];
                        a = _mm512_fmadd_ps(_mm512_set1_ps(xl[r * ldx + j]), w, a);
                    }
                }
            }
            UNROLL for (int r = 0; r < R; ++r) {
                __m512 total = acc[r][0];
                UNROLL for (int p = 1; p < P; ++p) total = _mm512_add_ps(total, acc[r][p]);
                float* out = sums + r * kPanel + 16 * half;
                _mm512_storeu_ps(out, first ? _mm512_mul_ps(total, s)
                                            : _mm512_fmadd_ps(total, s, _mm512_loadu_ps(out)));
            }
        }
    }
}
#else
constexpr bool kZmmDecode = false;
template <int B, int R>
static void fused_int_zmm(const Call&, const uint32_t*, int64_t, int64_t, const float*, int64_t, float*,
                          const uint32_t*) {}
#endif

// 8 values of row `in` from K position k as float32
static inline __m256 load8(const void* in, int64_t k, bool is_bf16) {
    return is_bf16 ? avx2::widen8((const bf16*)in + k) : _mm256_loadu_ps((const float*)in + k);
}
static inline float load1(const void* in, int64_t k, bool is_bf16) {
    return is_bf16 ? to_float(((const bf16*)in)[k]) : ((const float*)in)[k];
}

// x[k] *= 2^-(bits (k mod H)), H = 16 / bits values in a lane's low half: the scale fused_int's masked values carry
static inline void prescale(float* x, int64_t Kp, int bits) {
    alignas(32) float f[8];
    for (int i = 0; i < 8; ++i) f[i] = std::ldexp(1.f, -bits * (i % (16 / bits)));
    const __m256 fv = _mm256_load_ps(f);
    for (int64_t k = 0; k < Kp; k += 8) _mm256_storeu_ps(x + k, _mm256_mul_ps(_mm256_loadu_ps(x + k), fv));
}

// |v| <= 448 -> the nearest float8_e4m3fn value (ties to even), as float32: 3 mantissa bits kept where v is normal
// in e4m3 (>= 2^-6), multiples of 2^-9 below
static inline __m256 round_e4m3(__m256 v) {
    const __m256 sign = _mm256_set1_ps(-0.f), a = _mm256_andnot_ps(sign, v);
    const __m256i bits = _mm256_castps_si256(a);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 20), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7ffff)));
    const __m256 normal = _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(int32_t(0xfff00000u))));
    const __m256 tiny = _mm256_mul_ps(_mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(512.f)),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                      _mm256_set1_ps(1.f / 512.f));
    const __m256 r = _mm256_blendv_ps(normal, tiny, _mm256_cmp_ps(a, _mm256_set1_ps(0x1p-6f), _CMP_LT_OQ));
    return _mm256_or_ps(r, _mm256_and_ps(v, sign));
}

// x [n] (float32, in place) -> e4m3(clamp(x / s, +-448)) * s
static void fake_quant_e4m3(float* x, int64_t n, float s) {
    const __m256 sv = _mm256_set1_ps(s), hi = _mm256_set1_ps(448.f), lo = _mm256_set1_ps(-448.f);
    for (int64_t k = 0; k < n; k += 8) {
        alignas(32) float tail[8] = {};
        float* at = k + 8 <= n ? x + k : tail;
        if (at == tail) std::copy(x + k, x + n, tail);
        const __m256 q = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(at), sv), lo), hi);
        _mm256_storeu_ps(at, _mm256_mul_ps(round_e4m3(q), sv));
        if (at == tail) std::copy(tail, tail + (n - k), x + k);
    }
}

// A row of x rounded through e4m3 as quantize_fp8_ref rounds it: scale max(absmax, 1e-12) / 448 per row (kActToken)
// or per group of act_group columns (kActGroup), or the static scale
static void fake_quant_row(const Call& c, float* x) {
    if (c.act == kActStatic) return fake_quant_e4m3(x, c.K, c.act_scale);
    const int64_t g = c.act == kActGroup ? c.act_group : c.K;
    for (int64_t k0 = 0; k0 < c.K; k0 += g) {
        float amax = 0.f;
        for (int64_t k = k0; k < k0 + g; ++k) amax = std::max(amax, std::fabs(x[k]));
        fake_quant_e4m3(x + k0, g, std::max(amax, 1e-12f) / 448.f);
    }
}

// Output row `row`, panel p: v (the 32 columns' values, bias added) rounded once to the output dtype
static inline void store_row(const Call& c, int64_t row, int64_t p, int64_t ncols, const __m256 (&v)[4]) {
    if (c.bf16) {
        bf16* dst = (bf16*)c.out + row * c.ldo + p * kPanel;
        if (ncols == kPanel) return avx2::Bf16::store(dst, v);
        bf16 tmp[kPanel];
        avx2::Bf16::store(tmp, v);
        std::copy(tmp, tmp + ncols, dst);
    } else {
        float* dst = (float*)c.out + row * c.ldo + p * kPanel;
        if (ncols == kPanel) return avx2::F32::store(dst, v);
        float tmp[kPanel];
        avx2::F32::store(tmp, v);
        std::copy(tmp, tmp + ncols, dst);
    }
}

static inline void panel_bias(const Call& c, int64_t p, int64_t ncols, __m256 (&b)[4]) {
    float padded[kPanel] = {};
    if (c.bias) std::copy(c.bias + p * kPanel, c.bias + p * kPanel + ncols, padded);
    UNROLL for (int i = 0; i < 4; ++i) b[i] = _mm256_loadu_ps(padded + 8 * i);
}

// WNA16 / FP8: y = x W^T + b with W dequantized by D; float32 sums, rounded to the output dtype once
template <typename D>
static void dequant_linear(const Call& c) {
    const int64_t Kp = (c.K + 7) / 8 * 8, panels = (c.N + kPanel - 1) / kPanel;
    const int64_t groups = (Kp + c.group - 1) / c.group, panel_lanes = Kp / D::E * kPanel;
    const uint32_t* W = (const uint32_t*)c.w;
    avx2::split_work(c.M, panels, c.threads, [&](int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
        alignas(64) float sums[kChunk * kPanel];
        alignas(64) float wf[kDepthK * kPanel];
        static thread_local std::vector<float> rows_f32;  // the chunk's rows as float32, zero past K
        const int64_t ldx = (Kp + 15) / 16 * 16 + 16;
        for (int64_t m = m0; m < m1; m += kChunk) {
            const int64_t rows = std::min(kChunk, m1 - m);
            if ((int64_t)rows_f32.size() < rows * ldx) rows_f32.resize(rows * ldx);
            for (int64_t r = 0; r < rows; ++r) {
                const void* in = (const char*)c.x + (m + r) * c.ldx * (c.bf16 ? 2 : 4);
                float* out = rows_f32.data() + r * ldx;
                int64_t k = 0;
                for (; k + 8 <= c.K; k += 8) _mm256_storeu_ps(out + k, load8(in, k, c.bf16));
                for (; k < c.K; ++k) out[k] = load1(in, k, c.bf16);
                std::fill(out + c.K, out + Kp, 0.f);
                if (c.act != kActNone) fake_quant_row(c, out);
                if (D::kPrescale && rows <= kFusedRows) prescale(out, Kp, D::kPrescale);
            }
            const float* x = rows_f32.data();
            const int64_t full = rows / kBlock * kBlock, rest = rows - full;
            for (int64_t p = p0; p < p1; ++p) {
                const uint32_t* lanes = W + p * panel_lanes;
                const int64_t group_base = p * groups * kPanel;
                if (rows <= kFusedRows) {
                    if constexpr (D::kPrescale > 0) {
                        const uint32_t* next = p + 1 < p1 ? lanes + panel_lanes : nullptr;
                        constexpr int B = D::kPrescale;
                        if (kZmmDecode && rows == 1) fused_int_zmm<B, 1>(c, lanes, group_base, Kp, x, ldx, sums, next);
                        else if (kZmmDecode) fused_int_zmm<B, 2>(c, lanes, group_base, Kp, x, ldx, sums, next);
                        else if (rows == 1) fused_int<B, 1>(c, lanes, group_base, Kp, x, ldx, sums, next);
                        else fused_int<B, 2>(c, lanes, group_base, Kp, x, ldx, sums, next);
                    } else {
                        if (rows == 1) fused<D, 1>(c, lanes, group_base, Kp, x, ldx, sums);
                        else fused<D, 2>(c, lanes, group_base, Kp, x, ldx, sums);
                    }
                } else {
                    for (int64_t k0 = 0; k0 < Kp; k0 += kDepthK) {
                        const int64_t n = std::min(kDepthK, Kp - k0);
                        const bool first = k0 == 0;
                        dequant_block<D>(c, lanes, group_base, k0 / D::E, (k0 + n) / D::E, wf);
                        for (int64_t half = 0; half < 2; ++half) {  // columns 0-15, then 16-31
                            for (int64_t r = 0; r < full; r += kBlock)
                                avx2::tile<avx2::F32, kBlock, 2>(x + r * ldx + k0, ldx, wf + half * 16, n,
                                                                 sums + r * kPanel + half * 16, first);
                            if (rest > 2)
                                avx2::tail<avx2::F32, 2>(rest, x + full * ldx + k0, ldx, wf + half * 16, n,
                                                         sums + full * kPanel + half * 16, first);
                        }
                        if (rest && rest <= 2)
                            avx2::tail<avx2::F32, 4>(rest, x + full * ldx + k0, ldx, wf, n, sums + full * kPanel,
                                                     first);
                    }
                }
                const int64_t ncols = std::min(kPanel, c.N - p * kPanel);
                __m256 b[4];
                panel_bias(c, p, ncols, b);
                for (int64_t r = 0; r < rows; ++r) {
                    __m256 v[4];
                    UNROLL for (int i = 0; i < 4; ++i)
                        v[i] = _mm256_add_ps(_mm256_loadu_ps(sums + r * kPanel + 8 * i), b[i]);
                    store_row(c, m + r, p, ncols, v);
                }
            }
        }
    });
}

}  // namespace quant
