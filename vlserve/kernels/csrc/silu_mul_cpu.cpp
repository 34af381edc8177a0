// silu(gate) * up over the rows of a fused gate_up projection, in one pass: see vlserve/kernels/silu_mul_cpu.py.
// Rounds as torch's `F.silu(gate) * up` does: silu in float32 (x / (1 + exp(-x))), rounded to the dtype, then the
// product in float32, rounded to the dtype. float32 takes ATen's vector exp, as torch's silu; bf16 ATen's faster
// exp_u20, whose silu rounds to the same bf16 value on every input tests/kernels draw.
#include <ATen/cpu/vec/vec.h>
#include <omp.h>
#include <cstdint>
#include "vec_bf16.h"

namespace {

using vec_bf16::BVec;
using vec_bf16::round_bf16;
using vec_bf16::Vec;

inline Vec silu(const Vec& v) { return v / (Vec(1.0f) + v.neg().exp()); }
inline Vec silu_fast(const Vec& v) { return v / (Vec(1.0f) + v.neg().exp_u20()); }

void row_f32(const float* gate, const float* up, float* out, int64_t I) {
    int64_t j = 0;
    for (; j + Vec::size() <= I; j += Vec::size())
        (silu(Vec::loadu(gate + j)) * Vec::loadu(up + j)).store(out + j);
    if (j < I) {
        const int64_t n = I - j;
        (silu(Vec::loadu(gate + j, n)) * Vec::loadu(up + j, n)).store(out + j, n);
    }
}

void row_bf16(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out, int64_t I) {
    const int64_t step = BVec::size();
    for (int64_t j = 0; j < I; j += step) {
        const int64_t n = std::min(step, I - j);
        const BVec g = n == step ? BVec::loadu(gate + j) : BVec::loadu(gate + j, n);
        const BVec u = n == step ? BVec::loadu(up + j) : BVec::loadu(up + j, n);
        auto [g0, g1] = at::vec::convert_to_float<c10::BFloat16>(g);
        auto [u0, u1] = at::vec::convert_to_float<c10::BFloat16>(u);
        const BVec o = vec_bf16::to_bf16(round_bf16(silu_fast(g0)) * u0, round_bf16(silu_fast(g1)) * u1);
        if (n == step)
            o.store(out + j);
        else
            o.store(out + j, n);
    }
}

}  // namespace

// gate_up [T, 2I] (row stride ld), gate the first I columns, up the next I; out [T, I] contiguous; float32 or bf16.
extern "C" void kernel(const void* gate_up, void* out, int64_t T, int64_t I, int64_t ld, int64_t is_bf16,
                       int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        if (is_bf16) {
            const auto* row = (const c10::BFloat16*)gate_up + t * ld;
            row_bf16(row, row + I, (c10::BFloat16*)out + t * I, I);
        } else {
            const auto* row = (const float*)gate_up + t * ld;
            row_f32(row, row + I, (float*)out + t * I, I);
        }
    }
}
