"""`y = x W^T + b` in bfloat16 on CPUs with AVX512-BF16, in C++: the decoder's projections at small batch.

oneDNN's bf16 matmul pays a fixed cost per call and keeps the cores busy only at large M; at the few rows of a
decode step it ran at 250-310 GFLOP/s on 2 cores that do ~430 (and at M=1 it read weights at a fifth of the
memory bandwidth). Here the weight is packed once, at load time, into panels of 32 output columns whose K pairs
are interleaved (`[N/32, K/2, 32, 2]`), the layout `vdpbf16ps` reads: one instruction multiplies a broadcast pair
of x's bf16 values with a pair from each of 16 columns and adds both products into float32 lanes. A register
block of up to 8 rows x 32 columns runs down K; each thread streams its own contiguous range of panels once per
chunk of 64 rows, so a decode step reads each weight once, in order. The sums are float32 (the bias too), rounded
to bf16 once at the end, as oneDNN does; only the order of the additions differs.

The source is built through inductor's C++ toolchain on first use, like `cpu_decode`. Where the CPU lacks
AVX512-BF16, no compiler works, or $VLSERVE_CPU_LINEAR_KERNEL is "0", `cpu_linear_supported` is False and the
layers keep `F.linear`.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = (Path(__file__).parent / "csrc" / "cpu_linear.cpp").read_text()

_DECLARATION = """
#include <cstdint>
extern "C" void kernel(const void* a, int64_t lda, const void* packed, const void* bias, int64_t has_bias, void* c,
                       int64_t ldc, int64_t M, int64_t N, int64_t K, int64_t threads);
"""
_ARG_TYPES = ["const void*", "int64_t", "const void*", "const void*", "int64_t", "void*", "int64_t", "int64_t",
              "int64_t", "int64_t", "int64_t"]
PANEL = 32  # output columns per packed panel
DISABLE_ENV = "VLSERVE_CPU_LINEAR_KERNEL"  # "0": the layers keep F.linear
_NO_BIAS = torch.empty(0, dtype=torch.bfloat16)


@functools.cache
def cpu_linear_kernel():
    """The compiled kernel (built on first use), or None where this CPU or toolchain cannot run it."""
    if not torch.cpu._is_avx512_bf16_supported():
        return None
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        return CppPythonBindingsCodeCache.load_pybinding(_ARG_TYPES, _DECLARATION, kernel_code=_SOURCE,
                                                         kernel_needs_vec_isa=True)
    except Exception as exc:  # no compiler, or an inductor without this loader: F.linear stays
        logger.warning("the C++ bf16 CPU linear could not be built (%s: %s); using F.linear",
                       type(exc).__name__, exc)
        return None


def cpu_linear_supported(weight: torch.Tensor) -> bool:
    """Whether `pack_linear_weight(weight)` and `cpu_linear` serve this [N, K] weight: a CPU bf16 matrix with an
    even K, a kernel built here, and not switched off by $VLSERVE_CPU_LINEAR_KERNEL=0."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % 2 == 0 and weight.shape[1] > 0 and os.environ.get(DISABLE_ENV, "1") != "0"
            and cpu_linear_kernel() is not None)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/32), K/2, 32, 2]: panels of 32 output rows (zero-padded), K pairs interleaved."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.new_zeros(panels * PANEL, k)
    padded[:n] = weight
    return padded.view(panels, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()


# Defined through torch.library.Library rather than the custom_op decorator: its dispatch costs ~8 us a call
# instead of ~14, and a decode step makes four calls per layer.
_LIB = torch.library.Library("vlserve", "FRAGMENT")
_LIB.define("cpu_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")


def _cpu_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., K] bf16 times a `pack_linear_weight` matrix (+ bias [N]) -> [..., N] bf16."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"vlserve::cpu_linear takes bfloat16 inputs, got {x.dtype}")
    k = x.shape[-1]
    rows = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = x.new_empty(rows.shape[0], out_features)
    if rows.shape[0]:
        cpu_linear_kernel()(rows, rows.stride(0), packed, _NO_BIAS if bias is None else bias, int(bias is not None),
                            out, out_features, rows.shape[0], out_features, k, torch.get_num_threads())
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


_LIB.impl("cpu_linear", _cpu_linear, "CPU")


@torch.library.register_fake("vlserve::cpu_linear")
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


cpu_linear = torch.ops.vlserve.cpu_linear  # the op: (x, packed, bias or None, out_features) -> [..., N]
