"""quick-GELU (`x * sigmoid(1.702 x)`, Qwen2-VL's and CLIP's tower MLP) on CPU in one C++ pass
(csrc/quick_gelu_cpu.cpp), where torch makes three passes over memory and rounds between them.

The kernel rounds as the three torch ops do: each op in float32, rounded to the dtype before the next. float32 uses
torch.sigmoid's vector exp (the same values, but for torch's scalar tail loop: an ulp at most); bf16 a faster exp
within 2e-7 relative, whose results round to the same bf16 values on the inputs tests/kernels/test_quick_gelu_cpu.py
draws; values below float32's smallest normal round to zero where the CPU rounds to bf16 in one instruction
(csrc/vec_bf16.h). Taken for contiguous float32 / bf16 CPU tensors where the kernel builds (not with
$VLSERVE_CPU_QUICK_GELU_KERNEL=0); the torch expression runs otherwise.
"""

from __future__ import annotations

import os

import torch

from vlserve.kernels.cpp_build import load_cpu_kernel

DISABLE_ENV = "VLSERVE_CPU_QUICK_GELU_KERNEL"
QUICK_GELU_ALPHA = 1.702  # quick_gelu(x) = x * sigmoid(QUICK_GELU_ALPHA * x)
_DECLARATION = """
#include <cstdint>
extern "C" void kernel(const void* x, void* y, int64_t n, int64_t is_bf16, int64_t threads);
"""
_ARG_TYPES = ("const void*", "void*", "int64_t", "int64_t", "int64_t")


def quick_gelu_ref(x: torch.Tensor) -> torch.Tensor:
    """The torch expression HF's `QuickGELUActivation` evaluates."""
    return x * torch.sigmoid(QUICK_GELU_ALPHA * x)


def quick_gelu_cpu_kernel():
    """The compiled kernel (built on first use), or None where it cannot be built here."""
    return load_cpu_kernel("quick_gelu_cpu.cpp", _DECLARATION, _ARG_TYPES)


def _takes(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.is_contiguous()
        and not x.requires_grad
        and not torch.compiler.is_compiling()
        and os.environ.get(DISABLE_ENV, "1") != "0"
        and quick_gelu_cpu_kernel() is not None
    )


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """`quick_gelu_ref(x)` in a new tensor of x's shape and dtype; one pass on CPU where the kernel applies."""
    if not _takes(x):
        return quick_gelu_ref(x)
    out = torch.empty_like(x)
    quick_gelu_cpu_kernel()(x, out, x.numel(), int(x.dtype is torch.bfloat16), torch.get_num_threads())
    return out
