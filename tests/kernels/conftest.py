"""Kernel tests run the Triton kernels under Triton's CPU interpreter.

TRITON_INTERPRET is read when a `@triton.jit` function is defined, so it must be set before the
vlserve Triton modules are imported; `vlserve.kernels` imports them lazily, and the torch path
never looks at this variable.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
