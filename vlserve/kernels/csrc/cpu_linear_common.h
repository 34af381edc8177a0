// Shared by cpu_linear.cpp, quant_linear.cpp and lora_cpu.cpp (pasted into each, once): what cpu_linear_avx2.cpp's register
// blocks expect.
#include <cstdint>
#include <cstring>

// Unrolls a loop over a register block's rows or vectors: GCC keeps an accumulator array in registers only once its
// loops are unrolled early (otherwise it stores every accumulator to the stack on every step)
#define UNROLL _Pragma("GCC unroll 16")

typedef uint16_t bf16;
constexpr int64_t kPanel = 32;  // output columns per packed panel

static inline float to_float(float v) { return v; }
static inline float to_float(bf16 v) {
    const uint32_t bits = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

// What a block does with its sums (float32, bias added): store them (rounded to T once), keep them as the gate of
// SiLU(gate) * up (rounded to T, as the projection's output would be), take them as up and store the product, or
// store SiLU of them (rounded to T before and after, as the projection then the activation would round).
enum Epilogue { kStore, kGate, kSiluMul, kStoreSilu };

