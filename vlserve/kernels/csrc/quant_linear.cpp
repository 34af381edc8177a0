// Quantized linear layers on packed weights (see vlserve/kernels/quant_linear_cpu.py), on AVX2 + FMA; the same code
// runs on AVX-512 CPUs (built there under AVX-512 flags and -march=native, so the compiler may use EVEX encodings
// and 32 vector registers), with the INT8 sums through vpdpwssd where the CPU has AVX512-VNNI.
// - WNA16 (4- and 8-bit integer weights, per-group scale and zero) and FP8 (e4m3 weights, per-group scale),
//   quant_linear_avx2.cpp: the weights are dequantized to float32 in registers and summed by float32 FMAs. At 1-2
//   rows (decode) inside the FMA loop, integer weights as x (q - z) per group times the group's scale; at more rows
//   a K block of a panel at a time, each weight exactly as the reference dequantizes it, into an L1 scratch that
//   cpu_linear's float32 register blocks then read.
// - INT8 W8A8, quant_linear_int8.cpp: activations quantized per row here (as quantize_rows_int8), int8 x int8
//   products summed exactly in int32 lanes (int16 pairs), rescaled in float32 as the reference does.
// quant_linear_cpu.py pastes the quoted includes below into one source: inductor compiles a single string.
#pragma GCC target("f16c")  // fp16 group scales (every AVX2 CPU has F16C; inductor's AVX-512 flags omit it)
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include <sys/syscall.h>
#include <unistd.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "quant_linear is built for AVX2 + FMA or AVX-512 only"
#endif

#include "amx_tiles.h"

// what cpu_linear_avx2.cpp expects (the float32 register blocks come from there)
#include "cpu_linear_common.h"
#include "cpu_linear_avx2.cpp"
#include "quant_linear_avx2.cpp"
#include "quant_linear_amx.cpp"
#include "quant_linear_amx_int4.cpp"
#include "quant_linear_int8.cpp"
#include "quant_linear_amx_int8.cpp"

enum Op { kReport = 0, kW4 = 1, kW8 = 2, kFp8 = 3, kInt8 = 4, kInt8Quant = 5, kInt8Epilogue = 6 };

// op: which family (Op); x: [M, K] float32 or bf16 (flags & 1: bf16, the output's dtype too), rows ldx apart;
// w, scales, zeros: the packed operands of quant_linear_cpu.py's pack_* (zeros only for kW4 / kW8); bias: float32
// [N] or null; out: [M, N], rows ldo apart; group: K positions per scale group (a multiple of 8, or the padded K);
// (flags >> 1) & 3: the scales' dtype (0 float32, 1 float16, 2 bfloat16); flags & 8: bias is given. act (kFp8):
// x rounded through e4m3 first, as quantize_fp8_ref: act & 3 a quant::Act, act >> 2 the columns of a group, and
// for kActStatic zeros points at the float32 scale.
// kInt8Quant and kInt8Epilogue are the two ends of W8A8 through torch's int8 matmul: x [M, K] -> int8 out [M, ldo]
// and its row scales into `scales` (float32 [M]); then the sums x [M, N] (rows ldx apart; int32, or with act 1 the
// float32 of int32 sums), row scales w (float32 [M]), column scales `scales` (float32 [N]) and the bias -> out
// [M, N] in the output dtype (flags & 1: bf16).
// op kReport writes out[0] (int64) = the vector width in bits (256), out[1] = 1 where the INT8 sums go through
// vpdpwssd (AVX512-VNNI), else 0, out[2] = 1 where WNA16 and FP8 may run on AMX tiles (flags & 16), and out[3] = 1
// where W8A8 may (flags & 32, `w` packed by pack_int8_amx; the tile state granted, asked for here).
extern "C" void kernel(int64_t op, const void* x, int64_t ldx, const void* w, const void* scales, const void* zeros,
                       const void* bias, void* out, int64_t ldo, int64_t M, int64_t N, int64_t K, int64_t group,
                       int64_t threads, int64_t flags, int64_t act) {
    if (op == kReport) {
        ((int64_t*)out)[0] = 256;
        ((int64_t*)out)[1] = quant::kVnni;
        ((int64_t*)out)[2] = quant::kAmx;
        ((int64_t*)out)[3] = quant::kAmxInt8 && quant::amx_permitted();
        return;
    }
    const float* b = (flags & 8) ? (const float*)bias : nullptr;
    const int mode = op == kFp8 ? int(act & 3) : op == kInt8Epilogue ? int(act) : quant::kActNone;
    const float act_scale = mode == quant::kActStatic ? *(const float*)zeros : 0.f;
    const quant::Call c{x, ldx, w, scales, zeros, b, out, ldo, M, N, K, group, threads, (flags & 1) != 0,
                        int((flags >> 1) & 3), mode, act >> 2, act_scale};
    // flags & 16: WNA16 / FP8 on the tile unit where this build and process have it (bf16 x, and for FP8 one scale
    // per column and per-token or static activations; the caller picks by rows)
    const bool amx = (flags & 16) && (op == kW4 || op == kW8 || op == kFp8) && quant::amx_serves(c, op == kFp8);
    // flags & 32: W8A8 on the int8 tile unit, `w` packed for it (pack_int8_amx); flags & 64 with it: `w` is a
    // gate_up matrix [2N, K] and out gets silu(gate) * up [M, N]
    const bool amx_int8 = (flags & 32) && op == kInt8 && quant::kAmxInt8;
    switch (op) {
        case kW4:
            if (!amx) quant::dequant_linear<quant::IntW<4>>(c);
            else if (quant::lookup_serves(c)) quant::amx_lookup_linear(c);
            else quant::amx_dequant_linear<quant::IntV<4>>(c);
            break;
        case kW8: amx ? quant::amx_dequant_linear<quant::IntV<8>>(c) : quant::dequant_linear<quant::IntW<8>>(c); break;
        case kFp8: amx ? quant::amx_dequant_linear<quant::Fp8V>(c) : quant::dequant_linear<quant::Fp8W>(c); break;
        case kInt8: amx_int8 ? quant::amx_int8_linear(c, flags & 64) : quant::int8_linear(c); break;
        case kInt8Quant: quant::quantize_rows_int8(c); break;
        case kInt8Epilogue: quant::int8_epilogue(c); break;
        default: break;
    }
}
