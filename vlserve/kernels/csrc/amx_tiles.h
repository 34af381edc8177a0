// What the AMX kernels share (cpu_linear_amx.cpp, quant_linear_amx.cpp, quant_linear_amx_int8.cpp): the tile
// configuration, the request for the tile state, and one panel's sums. Empty where the source is built without
// AMX-TILE; its products need AMX-BF16 / AMX-INT8 too.
#ifndef VLSERVE_AMX_TILES_H  // (pasted into one source by cpu_linear.py's _source: a guard, not pragma once)
#define VLSERVE_AMX_TILES_H
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>

namespace amx_tiles {

struct alignas(64) TileConfig {  // palette 1: every tile 16 rows of 64 bytes
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Linux hands a process the tile data state on request (oneDNN asks too; asking twice is harmless)
static inline bool permitted() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ok;
}

// Loads tiles 0-7 as 16 rows of 64 bytes (tiles 0-3 the sums, 4-5 x, 6-7 the matrix): once per thread and call
static inline void configure() {
    TileConfig cfg;
    for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    _tile_loadconfig(&cfg);
}

// The tile products: bf16 pairs into float32 sums, or int8 quads into exact int32 sums. The four products of a
// step spelled out: GCC's intrinsics paste their tile numbers into the assembly text, so they must be literals.
#define VLSERVE_AMX_DOT(Name, op)                         \
    struct Name {                                          \
        static inline void lo0() { op(0, 4, 6); }          \
        static inline void hi0() { op(1, 4, 7); }          \
        static inline void lo1() { op(2, 5, 6); }          \
        static inline void hi1() { op(3, 5, 7); }          \
    };
#if defined(__AMX_BF16__)
VLSERVE_AMX_DOT(Bf16Dot, _tile_dpbf16ps)
#endif
#if defined(__AMX_INT8__)
VLSERVE_AMX_DOT(Int8Dot, _tile_dpbssd)
#endif
#undef VLSERVE_AMX_DOT

// One panel's sums [32 rows (16 where !two), 32 columns] into `sums` (rows 128 bytes apart: 32 float32 or int32),
// over `steps` tile steps. x: A tiles of 16 rows x 64 bytes, step s of the first row block at a + s * a_step
// bytes, of the second a_block bytes further; the matrix: step s's two B tiles (columns 0-15, 16-31) at b + s *
// b_step and b_half bytes after it, rows b_stride bytes apart. !b_two: the first B tile only (sums' columns 16-31
// left as they were).
template <typename Dot>
static inline void panel_sums(const void* a, int64_t a_step, int64_t a_block, const void* b, int64_t b_step,
                              int64_t b_half, int64_t b_stride, int64_t steps, bool two, void* sums,
                              bool b_two = true) {
    const char* x = (const char*)a;
    const char* w = (const char*)b;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; ++s) {
        const char* bt = w + s * b_step;
        _tile_loadd(4, x + s * a_step, 64);
        _tile_loadd(6, bt, b_stride);
        Dot::lo0();
        if (b_two) {
            _tile_loadd(7, bt + b_half, b_stride);
            Dot::hi0();
        }
        if (two) {
            _tile_loadd(5, x + a_block + s * a_step, 64);
            Dot::lo1();
            if (b_two) Dot::hi1();
        }
    }
    char* out = (char*)sums;
    _tile_stored(0, out, 128);
    if (b_two) _tile_stored(1, out + 64, 128);
    if (two) {
        _tile_stored(2, out + 16 * 128, 128);
        if (b_two) _tile_stored(3, out + 16 * 128 + 64, 128);
    }
}

}  // namespace amx_tiles
#endif  // __AMX_TILE__
#endif  // VLSERVE_AMX_TILES_H
