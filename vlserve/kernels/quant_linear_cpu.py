"""The CPU kernels of `quant_linear`: C++ (`csrc/quant_linear*.cpp`) on weights packed once, at load time, in
panels of 32 output columns, built on first use through inductor's C++ toolchain like `cpu_linear`, whose AVX2
float32 register blocks and work split they reuse. Where this CPU or toolchain cannot build it, or
$VLSERVE_QUANT_CPU_KERNEL is "0", `quant_kernel()` is None and `prepare_*` keep the canonical tensors (the float32
references run). See `quant_linear`'s docstring for what runs where and how fast.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from vlserve.kernels import cpu_linear
from vlserve.kernels.cpp_build import load_cpu_kernel

PANEL = 32  # output columns per packed panel
DISABLE_ENV = "VLSERVE_QUANT_CPU_KERNEL"  # "0": keep the canonical tensors, run the float32 references
OP_W4, OP_W8, OP_FP8, OP_INT8, OP_INT8_QUANT, OP_INT8_EPILOGUE = 1, 2, 3, 4, 5, 6  # the C++ entry's `op`
_SCALE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # group scales kept as stored (exact)
_DECLARATION = """
#include <cstdint>
extern "C" void kernel(int64_t op, const void* x, int64_t ldx, const void* w, const void* scales, const void* zeros,
                       const void* bias, void* out, int64_t ldo, int64_t M, int64_t N, int64_t K, int64_t group,
                       int64_t threads, int64_t flags, int64_t act);
"""
_ARG_TYPES = [
    "int64_t",
    "const void*",
    "int64_t",
    "const void*",
    "const void*",
    "const void*",
    "const void*",
    "void*",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
]
_NONE = torch.empty(0)


@functools.cache
def build_quant_linear(isa: str):
    """The kernel built for `isa` ("avx512": AVX-512 flags, the INT8 sums through vpdpwssd where the CPU has
    AVX512-VNNI; "avx2": never vpdpwssd), or None where this CPU or toolchain cannot run it. Both builds run the same
    AVX2 code otherwise."""
    if isa not in cpu_linear.isas_here():
        return None
    prefix = ""
    if isa == "avx2" and cpu_linear._vec_isa() == "avx512":
        prefix = "#define VLSERVE_FORCE_AVX2 1\n"  # another source text, so another cache entry
    return load_cpu_kernel("quant_linear.cpp", _DECLARATION, tuple(_ARG_TYPES), prefix, "the float32 references")


@functools.cache
def quant_kernel():
    """The compiled kernel `quant_matmul` calls (built on first use): the "avx512" build on AVX-512 CPUs, "avx2" on
    AVX2 ones or with $VLSERVE_CPU_ISA=avx2; None where neither builds or $VLSERVE_QUANT_CPU_KERNEL is "0"."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    native = cpu_linear._vec_isa()
    isa = "avx2" if native and os.environ.get(cpu_linear.ISA_ENV, "") == "avx2" else native
    return build_quant_linear(isa) if isa else None


def quant_kernel_info(kernel=None) -> dict:
    """What the kernel was built with: {"width": 256, "vnni": True where INT8 sums go through vpdpwssd, "amx": True
    where WNA16 and FP8 can run on AMX tiles, "amx_int8": True where W8A8 can}."""
    kernel = kernel or quant_kernel()
    report = torch.zeros(4, dtype=torch.int64)
    kernel(0, _NONE, 0, _NONE, _NONE, _NONE, _NONE, report, 0, 0, 0, 0, 0, 1, 0, 0)
    return {"width": int(report[0]), "vnni": bool(report[1]), "amx": bool(report[2]), "amx_int8": bool(report[3])}


AMX_ROWS_ENV = "VLSERVE_QUANT_AMX_ROWS"  # "0": never; N: WNA16 bf16 inputs of N+ rows (FP8: all) on AMX tiles
AMX_ROWS = 4  # from here the tile path beat the register kernel on a 2-core AMX Xeon (docs/benchmarks.md)
AMX_INT4_ROWS = 3  # 4-bit by table lookup (groups of whole tile steps): 0.6x the register kernel's time at 3 rows


def amx_rows(default: int = AMX_ROWS) -> int | None:
    """From how many rows a bf16 input to a WNA16 matrix runs on the AMX tiles (the weights made bf16 once per
    call, then tdpbf16ps), or None where this kernel has no AMX path (FP8 where it is not None: every row count);
    $VLSERVE_QUANT_AMX_ROWS overrides."""
    forced = cpu_linear.forced_rows(AMX_ROWS_ENV)
    rows = default if forced is None else forced
    kernel = quant_kernel()
    return rows if rows and kernel is not None and _amx_built(kernel) else None


@functools.cache
def _amx_built(kernel) -> bool:
    return quant_kernel_info(kernel)["amx"]


@functools.cache
def _amx_int8_built(kernel) -> bool:
    return quant_kernel_info(kernel)["amx_int8"]


@dataclass
class PackedQuant:
    """A quantized matrix in the C++ kernel's layout (csrc/quant_linear_*.cpp say it): `weight` the packed panels,
    `scales` and `zeros` ([N/32, G, 32] groups or, INT8, [N/32 * 32] channels; zeros: FP8's static input scale,
    else empty but for WNA16), `group` K positions per group, `scale_dtype` 0/1/2 for float32/float16/bf16 scales,
    `act` FP8's activation rounding (`fp8_act_code`), `amx_rows` from how many bf16 rows the AMX tiles multiply
    (0: never; `amx_rows()` when packed for WNA16; 1 for FP8 with one scale per column and per-token or static
    activations where `amx_rows()` is not None)."""

    op: int
    weight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    out_features: int
    in_features: int
    group: int = 0
    scale_dtype: int = 0
    act: int = 0
    amx_rows: int = 0


def _pad_rows(t: torch.Tensor, multiple: int = PANEL) -> torch.Tensor:
    """[N, ...] -> [ceil(N / multiple) * multiple, ...], zero rows appended."""
    n = t.shape[0]
    padded = t.new_zeros(-(-n // multiple) * multiple, *t.shape[1:])
    padded[:n] = t
    return padded


def _lanes(byte_cols: torch.Tensor) -> torch.Tensor:
    """uint8 [N, Kb] (Kb a multiple of 4, 4 bytes a lane) -> int32 [N/32, Kb/4, 32]: lane c of panel row l holds
    column c's bytes 4l .. 4l+3 (little-endian: byte j at bits 8j)."""
    n, kb = byte_cols.shape
    panels = _pad_rows(byte_cols).view(-1, PANEL, kb // 4, 4)  # [P, 32, Kb/4, 4]
    return panels.permute(0, 2, 1, 3).contiguous().view(torch.int32).squeeze(-1)  # [P, Kb/4, 32]


def _group_panels(t: torch.Tensor) -> torch.Tensor:
    """[N, G] per-column group values -> [N/32, G, 32] (zero-padded columns)."""
    g = t.shape[1]
    return _pad_rows(t).view(-1, PANEL, g).permute(0, 2, 1).contiguous()


def pack_wna16(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, bits: int
) -> PackedQuant | None:
    """Canonical q uint8 [N, K] (columns already in group order), scales [N, G], zeros [N, G] -> the kernel's form,
    or None where its layout cannot hold them (G > 1 with groups not a multiple of 8 positions long)."""
    n, k = q.shape
    kp = -(-k // 8) * 8
    groups = scales.shape[1]
    group = kp if groups == 1 else group_size
    if groups > 1 and (group % 8 or group * groups < k):
        return None
    groups = -(-kp // group)  # groups the kernel reads (a checkpoint may carry more)
    cols = torch.zeros(n, kp, dtype=torch.uint8)
    cols[:, :k] = q
    if bits == 4:  # two positions a byte: k even in the low nibble, k + 1 in the high one
        cols = cols[:, 0::2] | (cols[:, 1::2] << 4)  # [N, Kp/2]
    scales = scales[:, :groups]
    if scales.dtype not in _SCALE_DTYPES:
        scales = scales.float()
    return PackedQuant(
        OP_W4 if bits == 4 else OP_W8,
        _lanes(cols),
        _group_panels(scales),
        _group_panels(zeros[:, :groups].to(torch.uint8)),
        n,
        k,
        group,
        _SCALE_DTYPES[scales.dtype],
        amx_rows=amx_rows(AMX_INT4_ROWS if bits == 4 and (groups == 1 or group % 32 == 0) else AMX_ROWS) or 0,
    )


def fp8_act_code(act: str, act_group: int = 0) -> int:
    """The C++ kernel's code for an FP8 activation scheme: 1 per token, 2 | group << 2 per group, 3 static."""
    codes = {"token": 1, "group": 2, "static": 3}
    if act not in codes:
        raise ValueError(f"unknown FP8 activation scheme {act!r}")
    return codes[act] | (act_group << 2 if act == "group" else 0)


def pack_fp8(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    act: str,
    act_group: int = 0,
    input_scale: torch.Tensor | None = None,
) -> PackedQuant | None:
    """float8_e4m3fn [N, K] and its scale ([] / [N] / blocks [N/bn, K/bk]), and the activation scheme -> the
    kernel's form, or None where the layout cannot hold it (block columns not a multiple of 8; a scale of 256 or
    more, see Fp8W in the C++)."""
    n, k = weight.shape
    if act == "static" and input_scale is None or act == "group" and (act_group <= 0 or k % act_group):
        raise ValueError(
            f"FP8 activations {act!r} need a static input scale or groups dividing K = {k} "
            f"(got {input_scale}, {act_group})"
        )
    kp = -(-k // 8) * 8
    scale = scale.float()
    if not bool(torch.isfinite(scale).all()) or float(scale.abs().max()) >= 256:
        return None
    if block is None:
        per_col, group = (scale.reshape(1, 1).expand(n, 1) if scale.numel() == 1 else scale.reshape(n, 1)), kp
    else:
        bn, bk = block
        per_col, group = scale.repeat_interleave(bn, 0)[:n], bk  # [N, K/bk]
        if per_col.shape[1] == 1:
            group = kp
        elif bk % 8:
            return None
    cols = torch.zeros(n, kp, dtype=torch.uint8)
    cols[:, :k] = weight.view(torch.uint8)
    static = _NONE if input_scale is None else input_scale.float().reshape(1).contiguous()
    tiles = group == kp and act in ("token", "static")  # what the AMX path serves (csrc: amx_serves)
    return PackedQuant(
        OP_FP8,
        _lanes(cols),
        _group_panels(per_col.contiguous()),
        static,
        n,
        k,
        group,
        0,
        fp8_act_code(act, act_group),
        1 if tiles and amx_rows() else 0,  # every row count: a row's sums never depend on the batch's size
    )


def pack_int8(weight: torch.Tensor, scale: torch.Tensor) -> PackedQuant:
    """int8 [N, K] and its per-channel scale [N] -> int8 [N/32, Kp/2, 32, 2] (K pairs interleaved) and float32
    scales [N/32 * 32]; where the kernel multiplies int8 on AMX tiles (and $VLSERVE_QUANT_AMX_ROWS is not "0"), the
    tile layout instead (`pack_int8_amx`, `amx_rows` 1: every row count runs there; 1.1-2x faster than oneDNN's
    int8 matmul and than the register kernel from 1 to 512 rows on a 2-core Xeon, docs/benchmarks.md)."""
    n, k = weight.shape
    if amx_rows() and _amx_int8_built(quant_kernel()):
        return PackedQuant(
            OP_INT8, pack_int8_amx(weight), _pad_rows(scale.reshape(-1).float()), _NONE, n, k, amx_rows=1
        )
    kp = k + k % 2
    padded = torch.zeros(n, kp, dtype=torch.int8)
    padded[:, :k] = weight
    packed = _pad_rows(padded).view(-1, PANEL, kp // 2, 2).permute(0, 2, 1, 3).contiguous()
    return PackedQuant(OP_INT8, packed, _pad_rows(scale.reshape(-1).float()), _NONE, n, k)


def pack_int8_amx(weight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the tile unit's B layout: int8 [N/32, K64/64, 2, 16, 16, 4] (K64: K rounded up to 64): per
    panel of 32 columns and K step of 64, two tiles (columns 0-15, 16-31) whose row r holds K positions 64 s + 4 r
    .. + 3 of each of their 16 columns (csrc/quant_linear_amx_int8.cpp)."""
    n, k = weight.shape
    k64 = -(-k // 64) * 64
    padded = torch.zeros(-(-n // PANEL) * PANEL, k64, dtype=torch.int8)
    padded[:n, :k] = weight
    tiles = padded.view(-1, 2, 16, k64 // 64, 16, 4)  # [P, half, column, step, quad, 4]
    return tiles.permute(0, 3, 1, 4, 2, 5).contiguous()  # [P, step, half, quad, column, 4]


# Defined through torch.library.Library (as cpu_linear's ops): an opaque op to torch.compile, with a fake.
_LIB = torch.library.Library("vlserve", "FRAGMENT")
_LIB.define(
    "quant_linear_cpu(Tensor x, Tensor w, Tensor scales, Tensor zeros, Tensor? bias, int op, int out_features, "
    "int group, int scale_dtype, int act, int amx_rows=0, bool silu_mul=False) -> Tensor"
)


def _quant_linear_cpu(
    x: torch.Tensor,
    w: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bias: torch.Tensor | None,
    op: int,
    out_features: int,
    group: int,
    scale_dtype: int,
    act: int,
    amx_rows: int = 0,
    silu_mul: bool = False,
) -> torch.Tensor:
    """x [..., K] float32 or bf16 times a packed matrix (+ float32 bias [N]) -> [..., N] in x.dtype (`silu_mul`, a
    W8A8 gate_up matrix in the tile layout: silu(gate) * up, [..., N / 2]). Runs for every quantized projection of
    a decode step: the common case (2-D rows, unit stride) takes no detours."""
    rows = x
    if x.dim() != 2 or x.stride(1) != 1:
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(1) != 1:
            rows = rows.contiguous()
    m, k = rows.shape
    if silu_mul:
        out_features //= 2
    out = x.new_empty(m, out_features)
    if m:
        flags = (x.dtype is torch.bfloat16) | scale_dtype << 1 | (bias is not None) << 3
        if op == OP_INT8:
            flags |= 32 * bool(amx_rows) | 64 * silu_mul  # the tile layout: every row count on the AMX tiles
        else:
            flags |= 16 * bool(amx_rows and flags & 1 and m >= amx_rows)  # bf16 rows from the threshold on
        quant_kernel()(
            op,
            rows,
            rows.stride(0),
            w,
            scales,
            zeros,
            _NONE if bias is None else bias,
            out,
            out_features,
            m,
            out_features,
            k,
            group,
            torch.get_num_threads(),
            flags,
            act,
        )
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


def _fake(x, w, scales, zeros, bias, op, out_features, group, scale_dtype, act, amx_rows=0, silu_mul=False):
    return x.new_empty(*x.shape[:-1], out_features // 2 if silu_mul else out_features)


_LIB.impl("quant_linear_cpu", _quant_linear_cpu, "CPU")
torch.library.register_fake("vlserve::quant_linear_cpu")(_fake)


def quant_matmul(x: torch.Tensor, p: PackedQuant, bias: torch.Tensor | None, silu_mul: bool = False) -> torch.Tensor:
    """x [..., K] (float32, bf16 or float16: through float32) times the packed matrix (+ bias) -> [..., N] in
    x.dtype, the sums in float32 (INT8: x quantized per row first, int32 sums; FP8: x rounded through e4m3
    first; `silu_mul`: see `_quant_linear_cpu`). Eager calls skip the op's dispatch (~7 us of a ~15 us decode
    call); torch.compile sees the op."""
    dtype = x.dtype
    xk = x if dtype is torch.float32 or dtype is torch.bfloat16 else x.float()
    b = None if bias is None else bias.float().contiguous()
    run = torch.ops.vlserve.quant_linear_cpu if torch.compiler.is_compiling() else _quant_linear_cpu
    y = run(
        xk, p.weight, p.scales, p.zeros, b, p.op, p.out_features, p.group, p.scale_dtype, p.act, p.amx_rows, silu_mul
    )
    return y if y.dtype is dtype else y.to(dtype)


@dataclass
class OneDnnInt8:
    """An int8 [N, K] matrix prepacked by oneDNN for its int8 matmul (`torch.ops.onednn.qlinear_prepack`: the AMX
    tile layout, held once, not reordered per call), and the unit scales and zero points the call takes (the row
    and column scales are applied by our epilogue, in the reference's order)."""

    packed: torch.Tensor
    unit_scales: torch.Tensor  # float32 [N], ones
    unit_zeros: torch.Tensor  # int64 [N], zeros


def prepack_int8_onednn(weight: torch.Tensor) -> OneDnnInt8 | None:
    """int8 [N, K] -> oneDNN's prepacked form, where the CPU has AMX (elsewhere, or where this torch lacks the op,
    None: `torch._int_mm` multiplies the plain matrix). Measured on a 2-core AMX Xeon: 1.2-2x faster than
    `torch._int_mm` from 16 to 512 rows, the sums bit-equal (docs/benchmarks.md)."""
    if not cpu_linear._has_amx() or not hasattr(torch.ops.onednn, "qlinear_prepack"):
        return None
    n = weight.shape[0]
    return OneDnnInt8(
        torch.ops.onednn.qlinear_prepack(weight.contiguous(), None), torch.ones(n), torch.zeros(n, dtype=torch.int64)
    )


_MAX_OUT = 1 << 22  # rows of one oneDNN call x N: a 16 MB float32 output (a 40 MB one ran 4x slower per row)

_LIB.define(
    "int8_linear_onednn_cpu(Tensor x, Tensor weight, Tensor scale, Tensor? bias, Tensor? unit_scales=None, "
    "Tensor? unit_zeros=None) -> Tensor"
)


def _int8_sums(
    xq: torch.Tensor, weight: torch.Tensor, unit_scales: torch.Tensor | None, unit_zeros: torch.Tensor | None
) -> torch.Tensor:
    """int8 xq [M, K] . W^T -> the exact int32 sums [M, N]: through oneDNN's prepacked matmul (float32 of the
    sums: scales and zero points of one and zero) where `weight` is prepacked, else `torch._int_mm`."""
    if unit_scales is None:
        return torch._int_mm(xq, weight.t())  # weight [N, K] read transposed
    return torch.ops.onednn.qlinear_pointwise(
        xq, 1.0, 0, weight, unit_scales, unit_zeros, None, 1.0, 0, torch.float32, "none", [], ""
    )


def _int8_linear_onednn_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    unit_scales: torch.Tensor | None = None,
    unit_zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A8 with oneDNN's int8 matmul in the middle (`_int8_sums`) and both ends in C++: x [M, K] float32 or bf16
    quantized per row (as `quantize_rows_int8`), then the sums [M, N] rescaled (+ float32 bias [N]) into x.dtype in
    one pass. weight int8 [N, K] (or prepacked, with unit_scales / unit_zeros), scale float32 [N]."""
    m, k = x.shape
    n = scale.shape[0]
    kernel, threads = quant_kernel(), torch.get_num_threads()
    flags = int(x.dtype is torch.bfloat16) | (bias is not None) << 3
    xq = torch.empty(m, k, dtype=torch.int8)
    xs = torch.empty(m, dtype=torch.float32)
    kernel(OP_INT8_QUANT, x, x.stride(0), _NONE, xs, _NONE, _NONE, xq, k, m, 0, k, 0, threads, flags, 0)
    out = x.new_empty(m, n)
    step = max(1, _MAX_OUT // n)
    for r0 in range(0, m, step):
        r1 = min(m, r0 + step)
        sums = _int8_sums(xq[r0:r1], weight, unit_scales, unit_zeros)
        kernel(
            OP_INT8_EPILOGUE,
            sums,
            sums.stride(0),
            xs[r0:],
            scale,
            _NONE,
            _NONE if bias is None else bias,
            out[r0:],
            n,
            r1 - r0,
            n,
            k,
            0,
            threads,
            flags,
            int(sums.dtype is torch.float32),
        )
    return out


def _int8_fake(x, weight, scale, bias, unit_scales=None, unit_zeros=None):
    return x.new_empty(x.shape[0], scale.shape[0])


for _key in ("CPU", "MkldnnCPU"):  # a prepacked weight dispatches as MkldnnCPU
    _LIB.impl("int8_linear_onednn_cpu", _int8_linear_onednn_cpu, _key)
torch.library.register_fake("vlserve::int8_linear_onednn_cpu")(_int8_fake)


def int8_matmul_onednn(
    x: torch.Tensor, weight: torch.Tensor | OneDnnInt8, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., K] (float32 or bf16) times W8A8's int8 [N, K] (or its `OneDnnInt8`) with its float32 scale [N]
    (+ bias) -> [..., N] in x.dtype, through oneDNN's int8 matmul with the quantization and epilogue in C++:
    bit-equal to `int8_linear_ref`."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    b = None if bias is None else bias.float().contiguous()
    run = torch.ops.vlserve.int8_linear_onednn_cpu if torch.compiler.is_compiling() else _int8_linear_onednn_cpu
    if isinstance(weight, OneDnnInt8):
        y = run(rows, weight.packed, scale, b, weight.unit_scales, weight.unit_zeros)
    else:
        y = run(rows, weight, scale, b)
    return y.view(*x.shape[:-1], scale.shape[0])
