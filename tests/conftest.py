"""Run-wide test settings: the device tensor tests should use, and a guard against Triton's interpreter on CUDA.

On a CUDA machine the engine and the kernel tests run the real Triton kernels on the GPU; if
TRITON_INTERPRET were set for the whole run, every `@triton.jit` kernel would be built for the CPU
interpreter instead (slow, and wrong for CUDA tensors), so the run stops with a usage error. On CPU
the kernel tests build their own interpreted copies of the kernels (tests/kernels/_interpreted.py).
"""
from __future__ import annotations

import os

import pytest
import torch


def interpreter_requested() -> bool:
    """True when TRITON_INTERPRET is set to something other than empty or 0."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pytest_configure(config):
    if torch.cuda.is_available() and interpreter_requested():
        raise pytest.UsageError(
            "TRITON_INTERPRET is set on a CUDA machine: the Triton kernels would be built for the CPU "
            "interpreter. Unset it; the CPU kernel tests load interpreted kernels by themselves."
        )


@pytest.fixture(scope="session")
def device() -> torch.device:
    """cuda when a GPU is present (Triton kernels run for real), else cpu (kernels under the interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
