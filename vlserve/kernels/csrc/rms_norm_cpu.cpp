// RMSNorm with its residual add, one pass per row: see vlserve/kernels/rms_norm_cpu.py.
// Rounds as HF's ops round: s = residual + x in the tensor's dtype; y = s * rsqrt(mean(s^2) + eps) in float32,
// rounded to the dtype; out = weight * y rounded to the dtype (weight in the tensor's dtype). Only the order of
// the float32 sum of squares differs from torch's reduction.
#include <ATen/cpu/vec/vec.h>
#include <omp.h>
#include <cmath>
#include <cstdint>
#include "vec_bf16.h"

namespace {

using vec_bf16::BVec;
using vec_bf16::round_bf16;
using vec_bf16::Vec;
constexpr int64_t kChunk = 2 * Vec::size();  // elements a chunk: two float vectors, one bf16 vector

struct Chunk {
    Vec lo, hi;
};

template <bool kBf16>
inline Chunk load(const void* p, int64_t i, int64_t n) {  // lanes past n read as zeros
    if constexpr (kBf16) {
        const auto* q = (const c10::BFloat16*)p + i;
        const BVec raw = n == kChunk ? BVec::loadu(q) : BVec::loadu(q, n);
        auto [lo, hi] = at::vec::convert_to_float<c10::BFloat16>(raw);
        return {lo, hi};
    } else {
        const float* q = (const float*)p + i;
        if (n == kChunk) return {Vec::loadu(q), Vec::loadu(q + Vec::size())};
        const int64_t a = std::min<int64_t>(n, Vec::size());
        return {Vec::loadu(q, a), n > a ? Vec::loadu(q + a, n - a) : Vec(0.0f)};
    }
}

template <bool kBf16>
inline void store(void* p, int64_t i, const Chunk& c, int64_t n) {
    if constexpr (kBf16) {
        const BVec out = vec_bf16::to_bf16(c.lo, c.hi);
        auto* q = (c10::BFloat16*)p + i;
        if (n == kChunk) out.store(q);
        else out.store(q, n);
    } else {
        float* q = (float*)p + i;
        if (n == kChunk) {
            c.lo.store(q);
            c.hi.store(q + Vec::size());
            return;
        }
        const int64_t a = std::min<int64_t>(n, Vec::size());
        c.lo.store(q, a);
        if (n > a) c.hi.store(q + a, n - a);
    }
}

template <bool kBf16>
inline Chunk rnd(const Chunk& c) {
    if constexpr (kBf16) return {round_bf16(c.lo), round_bf16(c.hi)};
    else return c;
}

template <bool kBf16>
void run(const void* x, const void* residual, const void* weight, void* out, void* residual_out, int64_t T,
         int64_t H, float eps, int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const int64_t row = t * H;
        Vec acc(0.0f);
        for (int64_t j = 0; j < H; j += kChunk) {
            const int64_t n = std::min(kChunk, H - j);
            Chunk s = load<kBf16>(x, row + j, n);
            if (residual) {
                const Chunk r = load<kBf16>(residual, row + j, n);
                s = rnd<kBf16>({s.lo + r.lo, s.hi + r.hi});
                store<kBf16>(residual_out, row + j, s, n);
            }
            acc = acc + s.lo * s.lo + s.hi * s.hi;
        }
        float lanes[Vec::size()];
        acc.store(lanes);
        float sum = 0.0f;
        for (int64_t l = 0; l < Vec::size(); ++l) sum += lanes[l];
        const Vec scale(1.0f / std::sqrt(sum / float(H) + eps));
        const void* src = residual ? residual_out : x;
        for (int64_t j = 0; j < H; j += kChunk) {
            const int64_t n = std::min(kChunk, H - j);
            const Chunk s = load<kBf16>(src, row + j, n);
            const Chunk w = load<kBf16>(weight, j, n);
            const Chunk y = rnd<kBf16>({s.lo * scale, s.hi * scale});
            store<kBf16>(out, row + j, rnd<kBf16>({w.lo * y.lo, w.hi * y.hi}), n);
        }
    }
}

}  // namespace

// x, residual, out, residual_out: [T, H] contiguous; weight [H]; all float32, or all bf16 (is_bf16); eps: one
// float. With has_residual, residual_out gets residual + x and out the norm of it; without, both are unread.
extern "C" void kernel(const void* x, const void* residual, const void* weight, void* out, void* residual_out,
                       int64_t T, int64_t H, const float* eps, int64_t has_residual, int64_t is_bf16,
                       int64_t threads) {
    const void* r = has_residual ? residual : nullptr;
    if (is_bf16)
        run<true>(x, r, weight, out, residual_out, T, H, *eps, threads);
    else
        run<false>(x, r, weight, out, residual_out, T, H, *eps, threads);
}
