"""`y = x W^T + b` in C++ on packed weights, for CPUs with AVX-512 or AVX2 + FMA: the decoder's projections and LM
head and the encoders' linears (float32 and bf16), and a gated MLP's gate_up projection with SiLU(gate) * up in the
same pass.

oneDNN pays a fixed cost per call and keeps the cores busy only at large M; at the few rows of a decode step its bf16
matmul ran at 250-310 GFLOP/s on 2 AVX-512 cores that do ~430, its float32 one at ~170 of ~210, and at M=1 both
read the weights at a fraction of the memory bandwidth; on AVX2 CPUs without AVX512-BF16 its bf16 matmul is many
times slower than its float32 one. Here each weight is packed once, at load time, into panels of 32
output columns: `[N/32, K, 32]` in float32, `[N/32, K/2, 32, 2]` in bf16 (K pairs interleaved, the layout
`vdpbf16ps` reads: one instruction multiplies a broadcast pair of x's values with a pair from each of 16 columns
and adds both products into float32 lanes). Each thread streams its own contiguous range of panels once per chunk of
rows (or, with fewer panels than threads, takes a range of the rows), so a decode step reads each weight once, in
order. The sums are float32 (the bias too), rounded to bf16 once at the end as oneDNN does; only the order of the
additions differs.

What runs where (`cpu_linear_isa(dtype)` says, as the built kernel reports it):
- AVX-512 (the source is built for it when inductor builds for AVX-512): register blocks of up to 8 rows x 32
  columns of zmm FMAs down K, bf16 through `vdpbf16ps` where the CPU has AVX512-BF16. Only a panel's first row block
  waits on memory: while the later ones run from cache, the thread prefetches its next panel a line per step (3-6%
  of a batch-32 decode step on the bench model). float32 takes rows in chunks of 256 (a float32 panel is twice a
  bf16 one's bytes, so each panel fetched from memory must serve more rows), and from 128 rows with K >= 4,096 (a
  down projection at prefill) walks K in blocks of 256: the chunk's block of x, copied k-major, and each panel's
  block stay in L2 while the thread's panels pass, the partial sums waiting in the output (the additions in the same
  order, so every row count gives the same bits). Qwen2-VL-2B's down projection at 1,024 rows on 2 AMX Xeon cores:
  260-268 GFLOP/s (215-239 unblocked; torch's sgemm 354-370, which takes float32 towers on Intel CPUs:
  `torch_serves_many_rows`).
- AVX2 + FMA (where inductor builds for AVX2; on AVX-512 CPUs for bf16 without AVX512-BF16, and for everything with
  $VLSERVE_CPU_ISA=avx2, read when the kernel is built, so both paths can be tested on one machine): register
  blocks of 6 rows (bf16: 5) x 16 columns of ymm FMAs, each panel walked as two 16-column halves, K in blocks of 128
  panel rows so a half panel's block stays in L1; blocks of 1-2 rows (decode) take all 32 columns in one pass. bf16
  weights stay bf16 in memory and widen in registers (a 32-bit lane of a panel row holds one column's pair
  (k, k+1): `lane << 16` is the k value, `lane & 0xffff0000` the k+1 one); x's rows are copied (bf16: widened) to
  a float32 scratch once per chunk of rows, so its broadcasts read float32. On 2 Zen 3 cores (~200 GFLOP/s peak,
  shared with other jobs) at vision-tower shapes (1024-4096 rows) it ran at a median 128 GFLOP/s in bf16 (83-174;
  F.linear 11-21) and 146 in float32 (121-166; F.linear 136-171): `benchmarks/cpu_linear.py --gflops`.

`cpu_linear_silu_mul` is the gate_up projection of a SiLU-gated MLP followed by `silu(gate) * up`: the thread that
computes gate panel j computes up panel j next and writes only the product, rounded as the two elementwise ops
would round (gate and up to the dtype, silu to the dtype, then the product), so the [M, 2I] projection is never
written out and no separate activation kernel runs. Its optional `pre_act_add [M, 2I]` (float32) joins the gate and
up sums after the bias, before the rounding and the activation: a LoRA layer passes its gate_up delta there
(`lora_cpu.lora_add_cpu` into a zeroed float32 buffer) instead of recomputing gate_up unfused for its adapter rows;
rows of zeros come out bit-identical to the call without it (the sums are never -0, so adding +0 changes no bit).
That variant is its own instantiation: the kernel without the argument runs unchanged code.

`cpu_linear_silu` is a projection followed by SiLU (a vision tower's fc1 whose quick-GELU was folded into its
weights, `VisionMLP.fold_quick_gelu`): each output rounded to the dtype, activated, rounded again, as the matmul and
then `F.silu` would round, in the pass that stores it.

The source is built through inductor's C++ toolchain on first use, like `cpu_decode`. Where the CPU has neither
AVX-512 nor AVX2 + FMA, no compiler works, or $VLSERVE_CPU_LINEAR_KERNEL is "0", `cpu_linear_supported` is False
and the layers keep `F.linear`.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from vlserve.kernels.cpp_build import load_cpu_kernel

logger = logging.getLogger(__name__)

_BF16_DOT = torch.cpu._is_avx512_bf16_supported()  # an AVX-512 build targets AVX512-BF16: bf16 through vdpbf16ps
_DECLARATION = """
#include <cstdint>
extern "C" void kernel(const void* a, int64_t lda, const void* packed, const void* bias, int64_t has_bias, void* c,
                       int64_t ldc, int64_t M, int64_t N, int64_t K, int64_t threads, int64_t is_bf16,
                       int64_t epilogue, const void* add, int64_t ldadd, int64_t has_add);
"""
_ARG_TYPES = [
    "const void*",
    "int64_t",
    "const void*",
    "const void*",
    "int64_t",
    "void*",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
    "const void*",
    "int64_t",
    "int64_t",
]
PANEL = 32  # output columns per packed panel
DISABLE_ENV = "VLSERVE_CPU_LINEAR_KERNEL"  # "0": the layers keep F.linear
ISA_ENV = "VLSERVE_CPU_ISA"  # "avx2": build the AVX2 path even where the CPU has AVX-512
ISAS = ("avx512", "avx2")
ONEDNN_ROWS_ENV = "VLSERVE_CPU_ONEDNN_ROWS"  # "0": never hand rows to oneDNN; N: from N rows on, on any CPU
AMX_ROWS = {torch.bfloat16: 4, torch.int8: 16}  # where torch's matmul (oneDNN on AMX tiles) overtakes our kernels
ONEDNN_BF16_ROWS_OVER_TILES = 128  # bf16, where our kernel multiplies on AMX tiles too: oneDNN only from here
TILE_ROWS_ENV = "VLSERVE_CPU_AMX_ROWS"  # "0": never; N: bf16 inputs of N+ rows on the packed kernel's AMX tiles
TILE_ROWS = 2  # at 1 row the register path was as fast (2-core Xeon, docs/benchmarks.md)
_NO_BIAS = torch.empty(0)


def _vec_isa() -> str | None:
    """The vector ISA inductor builds kernel sources for on this machine: "avx512", "avx2", or None."""
    from torch._inductor.cpu_vec_isa import VecAVX2, VecAVX512, pick_vec_isa

    vec = pick_vec_isa()
    return "avx512" if isinstance(vec, VecAVX512) else "avx2" if isinstance(vec, VecAVX2) else None


def isas_here() -> list[str]:
    """The paths this machine can build and run: ["avx512", "avx2"] on AVX-512 CPUs, ["avx2"] on AVX2 ones."""
    native = _vec_isa()
    return [] if native is None else ISAS[ISAS.index(native) :]


@functools.cache
def build_cpu_linear(isa: str):
    """The kernel built with the `isa` path ("avx512" or "avx2", see the module docstring), or None where this CPU
    or toolchain cannot run it. Inductor compiles it with this machine's vector flags; the AVX2 path built under
    AVX-512 flags is the same code (and another source text, so another cache entry)."""
    if isa not in isas_here():
        return None
    prefix = ""
    if isa == "avx2" and _vec_isa() == "avx512":
        prefix = "#define VLSERVE_FORCE_AVX2 1\n"
    elif isa == "avx512" and _BF16_DOT:
        prefix = '#pragma GCC target("avx512bf16")\n'
    return load_cpu_kernel("cpu_linear.cpp", _DECLARATION, tuple(_ARG_TYPES), prefix, "F.linear")


@functools.cache
def cpu_linear_kernel():
    """The compiled kernel the layers call (built on first use): the AVX-512 path on AVX-512 CPUs, the AVX2 one on
    AVX2 CPUs or where $VLSERVE_CPU_ISA is "avx2"; None where this CPU or toolchain cannot run either."""
    requested = os.environ.get(ISA_ENV, "")
    if requested not in ("", "avx2"):
        logger.warning('$%s=%r is not a CPU linear path to force (only "avx2" is); ignored', ISA_ENV, requested)
    native = _vec_isa()
    isa = "avx2" if native and requested == "avx2" else native
    kernel = build_cpu_linear(isa) if isa else None
    if kernel is not None:
        logger.debug(
            "packed CPU linear built: float32 on its %s path, bf16 on its %s path",
            cpu_linear_isa(torch.float32, kernel),
            cpu_linear_isa(torch.bfloat16, kernel),
        )
    return kernel


def cpu_linear_isa(dtype: torch.dtype = torch.float32, kernel=None) -> str | None:
    """Which path of `kernel` (default: the layers' `cpu_linear_kernel()`) serves `dtype`, as the compiled code
    reports it: "avx512", "avx2", or None where there is no kernel."""
    kernel = kernel or cpu_linear_kernel()
    if kernel is None:
        return None
    width = torch.zeros(1, dtype=torch.int64)  # a call with M = -1 writes the path's vector width
    kernel(_NO_BIAS, 0, _NO_BIAS, _NO_BIAS, 0, width, 0, -1, 0, 0, 1, dtype is torch.bfloat16, 0, _NO_BIAS, 0, 0)
    return {512: "avx512", 256: "avx2"}[int(width)]


def _dtype_served(dtype: torch.dtype) -> bool:
    return dtype is torch.float32 or dtype is torch.bfloat16


def cpu_linear_supported(weight: torch.Tensor) -> bool:
    """Whether `pack_linear_weight(weight)` and `cpu_linear` serve this [N, K] weight: a CPU float32 or bf16 matrix
    (bf16 with an even K), a kernel built here, and not switched off by $VLSERVE_CPU_LINEAR_KERNEL=0."""
    return (
        weight.device.type == "cpu"
        and _dtype_served(weight.dtype)
        and weight.dim() == 2
        and weight.shape[1] > 0
        and (weight.dtype == torch.float32 or weight.shape[1] % 2 == 0)
        and os.environ.get(DISABLE_ENV, "1") != "0"
        and cpu_linear_kernel() is not None
    )


@functools.cache
def tile_rows() -> int:
    """From how many rows a bf16 input to the packed kernel runs on its AMX tiles (csrc/cpu_linear_amx.cpp: the
    packed panels read as B tiles, float32 sums), or 0 where the kernel here has none; $VLSERVE_CPU_AMX_ROWS
    overrides (read once: `tile_rows.cache_clear()` after changing it)."""
    kernel = cpu_linear_kernel()
    if kernel is None:
        return 0
    report = torch.zeros(1, dtype=torch.int64)  # a call with M = -2 writes whether bf16 can run on AMX tiles
    kernel(_NO_BIAS, 0, _NO_BIAS, _NO_BIAS, 0, report, 0, -2, 0, 0, 1, 1, 0, _NO_BIAS, 0, 0)
    if not int(report):
        return 0
    forced = forced_rows(TILE_ROWS_ENV)
    return TILE_ROWS if forced is None else forced


@functools.cache
def _has_amx() -> bool:
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe()) and torch.backends.mkldnn.is_available()


def onednn_min_rows(dtype: torch.dtype) -> int | None:
    """From how many rows torch's own matmul beats our kernel for weights of `dtype` here (bf16: the packed
    kernel; int8: W8A8's), or None where ours wins at every size. On CPUs with AMX torch runs oneDNN on the tile
    unit, measured on a 2-core Xeon on matrices prepacked for it (`onednn_linear`, `prepack_int8_onednn`): bf16 at
    0.4-0.9x the packed kernel's time at 4 rows, 0.3-0.4x at 8; int8 (quantizing included) even at 16 rows
    (docs/benchmarks.md). A GEMV (decode at 1-3 rows) stays faster in ours. $VLSERVE_CPU_ONEDNN_ROWS overrides: "0"
    never, N from N."""
    forced = forced_rows(ONEDNN_ROWS_ENV)
    if forced is not None:
        return forced or None
    if not _has_amx():
        return None
    if dtype is torch.bfloat16 and tile_rows():  # our tiles beat oneDNN's up to ~128 rows (docs/benchmarks.md)
        return max(ONEDNN_BF16_ROWS_OVER_TILES, tile_rows())
    return AMX_ROWS.get(dtype)


def torch_serves_many_rows(dtype: torch.dtype) -> bool:
    """Whether torch's matmul beats the packed kernel at the hundreds of rows of a tower's calls: float32 on Intel
    CPUs (MKL's sgemm: 340-370 GFLOP/s at 1,024 rows of Qwen2-VL-2B's tower shapes on 2 AMX Xeon cores, the packed
    kernel 265-330; on 2 AMD EPYC Zen 4 cores MKL ran 93-162 GFLOP/s at 1,024 rows of tower shapes against the
    packed kernel's 110-209), and the dtypes `onednn_min_rows` hands over. $VLSERVE_CPU_ONEDNN_ROWS="0" keeps every
    weight on the packed kernel."""
    forced = forced_rows(ONEDNN_ROWS_ENV)
    if forced is not None:
        return forced > 0
    return (dtype is torch.float32 and intel_cpu()) or onednn_min_rows(dtype) is not None


@functools.cache
def intel_cpu() -> bool:
    """Whether the CPU is Intel's (MKL, torch's float32 BLAS, takes its fastest kernels only there); True where
    /proc/cpuinfo cannot tell."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip() == "GenuineIntel"
    except OSError:
        pass
    return True


def forced_rows(env: str) -> int | None:
    """A row-count switch from $`env`: None when unset, else its count (0 or less: never, as 0); a ValueError naming
    the variable when it is not an integer."""
    forced = os.environ.get(env, "")
    if not forced:
        return None
    try:
        return max(0, int(forced))
    except ValueError:
        raise ValueError(f"${env} must be a row count (0: never), got {forced!r}") from None


def onednn_takes(x: torch.Tensor, min_rows: int | None) -> bool:
    """Whether `x [..., K]` has at least `min_rows` rows (an `onednn_min_rows` result; None: never)."""
    return min_rows is not None and x.numel() >= min_rows * x.shape[-1]


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> panels of 32 output rows (zero-padded): float32 [ceil(N/32), K, 32], bf16 [ceil(N/32), K/2, 32, 2]
    (K pairs interleaved)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.new_zeros(panels * PANEL, k)
    padded[:n] = weight
    if weight.dtype == torch.bfloat16:
        return padded.view(panels, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return padded.view(panels, PANEL, k).permute(0, 2, 1).contiguous()


# Defined through torch.library.Library rather than the custom_op decorator: its dispatch costs ~8 us a call
# instead of ~14, and a decode step makes three or four calls per layer.
_LIB = torch.library.Library("vlserve", "FRAGMENT")
_LIB.define("cpu_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")
_LIB.define(
    "cpu_linear_silu_mul(Tensor x, Tensor packed, Tensor? bias, int out_features, Tensor? pre_act_add=None) -> Tensor"
)
_LIB.define("cpu_linear_silu(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")
_PLAIN, _SILU_MUL, _SILU = 0, 1, 2  # the kernel's epilogues


def _addend(add: torch.Tensor, m: int, out_features: int) -> torch.Tensor:
    """`pre_act_add [..., 2I]` float32 as rows [m, 2I] with unit column stride (ValueError otherwise)."""
    if add.dtype is not torch.float32 or add.shape[-1] != 2 * out_features or add.numel() != m * 2 * out_features:
        raise ValueError(
            f"vlserve::cpu_linear_silu_mul's pre_act_add must be float32 [{m}, {2 * out_features}], got "
            f"{add.dtype} {tuple(add.shape)}"
        )
    add = add.reshape(m, 2 * out_features)
    return add if add.stride(1) == 1 else add.contiguous()


def _run(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    epilogue: int,
    name: str,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] times the packed matrix -> [..., out_features] (`_SILU_MUL`: SiLU(gate) * up of its halves, after
    `add [..., 2 out_features]` float32 joins the gate and up sums where given; `_SILU`: SiLU of each output). Runs
    four times per layer and step: the common case (2-D rows, unit stride, no add) takes no detours."""
    dtype = x.dtype
    if dtype is not packed.dtype or not _dtype_served(dtype):
        raise ValueError(
            f"vlserve::{name} takes inputs in its packed weight's dtype ({packed.dtype}, float32 or "
            f"bfloat16), got {dtype}"
        )
    shape = x.shape
    rows = x
    if len(shape) != 2 or x.stride(1) != 1:
        rows = x.reshape(-1, shape[-1])
        if rows.stride(1) != 1:
            rows = rows.contiguous()
    m, k = rows.shape
    out = x.new_empty(m, out_features)
    if add is not None:
        add = _addend(add, m, out_features)
    if m:
        is_bf16 = dtype is torch.bfloat16
        if is_bf16 and 0 < tile_rows() <= m:
            is_bf16 = 3  # on the AMX tiles (where K % 32 == 0; the kernel checks)
        cpu_linear_kernel()(
            rows,
            rows.stride(0),
            packed,
            _NO_BIAS if bias is None else bias,
            bias is not None,
            out,
            out_features,
            m,
            out_features,
            k,
            torch.get_num_threads(),
            is_bf16,
            epilogue,
            _NO_BIAS if add is None else add,
            0 if add is None else add.stride(0),
            add is not None,
        )
    return out if len(shape) == 2 else out.view(*shape[:-1], out_features)


def _cpu_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., K] times a `pack_linear_weight` matrix (+ bias [N]) -> [..., N] in x's dtype."""
    return _run(x, packed, bias, out_features, _PLAIN, "cpu_linear")


def _cpu_linear_silu(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """silu(x [..., K] times a `pack_linear_weight` matrix (+ bias [N])) -> [..., N] in x's dtype."""
    return _run(x, packed, bias, out_features, _SILU, "cpu_linear_silu")


def _cpu_linear_silu_mul(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    pre_act_add: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] times a packed gate_up matrix [2I, K] (+ bias [2I]), I = out_features a multiple of 32 ->
    silu(gate) * up [..., I]; `pre_act_add [..., 2I]` float32 (e.g. a LoRA delta of gate_up) joins the float32 gate
    and up sums after the bias: silu(gate + add[:I]) * (up + add[I:]). A zero row of it leaves that row's output
    bit-identical to the call without it."""
    if out_features % PANEL or packed.shape[0] * PANEL != 2 * out_features:
        raise ValueError(
            f"vlserve::cpu_linear_silu_mul needs a packed [2I, K] matrix with I a multiple of {PANEL}; "
            f"got {packed.shape[0]} panels for I = {out_features}"
        )
    return _run(x, packed, bias, out_features, _SILU_MUL, "cpu_linear_silu_mul", pre_act_add)


_LIB.impl("cpu_linear", _cpu_linear, "CPU")
_LIB.impl("cpu_linear_silu_mul", _cpu_linear_silu_mul, "CPU")
_LIB.impl("cpu_linear_silu", _cpu_linear_silu, "CPU")


def _fake(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    pre_act_add: torch.Tensor | None = None,
) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


for _op in ("cpu_linear", "cpu_linear_silu_mul", "cpu_linear_silu"):  # each returns [..., out_features] in x's dtype
    torch.library.register_fake(f"vlserve::{_op}")(_fake)


cpu_linear = torch.ops.vlserve.cpu_linear  # the op: (x, packed, bias or None, out_features) -> [..., N]
# (x, packed gate_up, bias or None, I, pre_act_add=None float32 [..., 2I]) -> [..., I]
cpu_linear_silu_mul = torch.ops.vlserve.cpu_linear_silu_mul
cpu_linear_silu = torch.ops.vlserve.cpu_linear_silu  # (x, packed, bias or None, out_features) -> silu of [..., N]
