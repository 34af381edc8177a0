"""`silu(gate) * up` over a fused gate_up projection's rows on CPU in one C++ pass (csrc/silu_mul_cpu.cpp), where
eager torch makes two passes and a temporary; for the rows the packed linear kernel does not fuse (prefill rows on
oneDNN). Rounds as `F.silu(gate) * up` does, but for values below float32's smallest normal, which round to zero
where the CPU rounds to bf16 in one instruction (csrc/vec_bf16.h). Taken for float32 / bf16 CPU rows with a contiguous last dim, outside
torch.compile, where the kernel builds and $VLSERVE_CPU_SILU_MUL_KERNEL is not 0; None otherwise.
"""

from __future__ import annotations

import os

import torch

from vlserve.kernels.cpp_build import load_cpu_kernel
from vlserve.kernels.onednn_linear import empty_rows

DISABLE_ENV = "VLSERVE_CPU_SILU_MUL_KERNEL"
_DECLARATION = """
#include <cstdint>
extern "C" void kernel(const void* gate_up, void* out, int64_t T, int64_t I, int64_t ld, int64_t is_bf16,
                       int64_t threads);
"""
_ARG_TYPES = ("const void*", "void*", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t")


def silu_mul_cpu_kernel():
    """The compiled kernel (built on first use), or None where it cannot be built here."""
    return load_cpu_kernel("silu_mul_cpu.cpp", _DECLARATION, _ARG_TYPES)


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor | None:
    """gate_up [T, 2I] (gate columns first) -> silu(gate) * up [T, I] in a new tensor; None where the kernel does
    not take it."""
    if not (
        gate_up.device.type == "cpu"
        and gate_up.dtype in (torch.float32, torch.bfloat16)
        and gate_up.dim() == 2
        and gate_up.shape[1] == 2 * intermediate
        and gate_up.stride(1) == 1
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and os.environ.get(DISABLE_ENV, "1") != "0"
        and silu_mul_cpu_kernel() is not None
    ):
        return None
    tokens = gate_up.shape[0]
    out = empty_rows(tokens, intermediate, dtype=gate_up.dtype)  # room for the down projection's padded rows
    silu_mul_cpu_kernel()(
        gate_up,
        out,
        tokens,
        intermediate,
        gate_up.stride(0),
        int(gate_up.dtype is torch.bfloat16),
        torch.get_num_threads(),
    )
    return out
