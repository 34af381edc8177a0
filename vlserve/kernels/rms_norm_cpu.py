"""RMSNorm with its residual add on CPU in one C++ pass per row (csrc/rms_norm_cpu.cpp), where eager torch makes
seven passes (the add, two casts, square, mean, scale, weight) over the step's hidden states.

It rounds as HF's ops do (the add and the weight product in the tensor's dtype, the statistics and the scaling in
float32); only the order of the float32 sum of squares differs from torch's reduction, so an output can sit one
step (a bf16 step, or float32's last bit) from eager's where the scale lands on a rounding boundary, and values below
float32's smallest normal round to zero where the CPU rounds to bf16 in one instruction (csrc/vec_bf16.h). Taken for
contiguous float32 / bf16 CPU rows whose weight has their dtype, outside torch.compile (inductor fuses the torch ops
itself), where the kernel builds and $VLSERVE_CPU_RMS_NORM_KERNEL is not 0; `rms_norm` returns None otherwise and
the caller runs torch. The model's RMSNorm keeps float32 rows on torch under activation quantization (W8A8, FP8),
where a last-bit difference can round to another int8 value than the checkpoint format's own library computes.
"""

from __future__ import annotations

import functools
import os

import torch

from vlserve.kernels.cpp_build import load_cpu_kernel
from vlserve.kernels.onednn_linear import empty_rows

DISABLE_ENV = "VLSERVE_CPU_RMS_NORM_KERNEL"
_DECLARATION = """
#include <cstdint>
extern "C" void kernel(const void* x, const void* residual, const void* weight, void* out, void* residual_out,
                       int64_t T, int64_t H, const float* eps, int64_t has_residual, int64_t is_bf16,
                       int64_t threads);
"""
_ARG_TYPES = ("const void*", "const void*", "const void*", "void*", "void*", "int64_t", "int64_t", "const float*",
              "int64_t", "int64_t", "int64_t")  # fmt: skip


def rms_norm_cpu_kernel():
    """The compiled kernel (built on first use), or None where it cannot be built here."""
    return load_cpu_kernel("rms_norm_cpu.cpp", _DECLARATION, _ARG_TYPES)


@functools.lru_cache(maxsize=16)
def _eps_tensor(eps: float) -> torch.Tensor:
    return torch.tensor([eps], dtype=torch.float32)


def _takes(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype == x.dtype
        and x.dim() == 2
        and x.is_contiguous()
        and weight.is_contiguous()
        and weight.shape == (x.shape[1],)
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()))
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and os.environ.get(DISABLE_ENV, "1") != "0"
        and rms_norm_cpu_kernel() is not None
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """x [T, H] (+ residual [T, H]) -> norm(x) or (norm(residual + x), residual + x) in new tensors, weight [H];
    None where the kernel does not take these tensors."""
    if not _takes(x, weight, residual):
        return None
    out = empty_rows(*x.shape, dtype=x.dtype)  # room for a oneDNN linear's padded rows (the next op)
    summed = torch.empty_like(x) if residual is not None else out
    rms_norm_cpu_kernel()(
        x,
        x if residual is None else residual,
        weight,
        out,
        summed,
        x.shape[0],
        x.shape[1],
        _eps_tensor(float(eps)),
        int(residual is not None),
        int(x.dtype is torch.bfloat16),
        torch.get_num_threads(),
    )
    return out if residual is None else (out, summed)
