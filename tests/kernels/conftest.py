"""Kernel-test fixtures: the Triton kernels on the test device, compiled on CUDA and interpreted on CPU.

With a GPU, `triton_kernels` is the ordinary vlserve.kernels.triton_* modules and the tests' tensors
are CUDA tensors (the `device` fixture from tests/conftest.py). Without one, it is a private copy of
those modules imported while TRITON_INTERPRET=1 was set for the length of that import only
(tests/kernels/_interpreted.py): Triton reads the variable when `@triton.jit` runs, so the copy's
kernels are interpreted while the process environment, `sys.modules` and every other test (the
engine's, the AOT compile check's) see no trace of it. Nothing here sets the variable for the run.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _interpreted import TRITON_MODULES, interpreted_triton_modules, native_triton_modules

from vlserve.kernels import cpu_linear


@pytest.fixture(scope="session")
def triton_kernels(device: torch.device) -> SimpleNamespace:
    """Namespace (kv_write, rotary, paged, prefill, attention, varlen) of vlserve Triton modules that run on
    `device`."""
    return native_triton_modules() if device.type == "cuda" else interpreted_triton_modules()


@pytest.fixture
def triton_dispatch(device: torch.device, triton_kernels: SimpleNamespace, monkeypatch) -> SimpleNamespace:
    """Make vlserve.kernels' triton backend reach `triton_kernels` for this test (on CPU: the interpreted copy)."""
    import vlserve.kernels as K

    if device.type != "cuda":
        by_module = {name: getattr(triton_kernels, short) for short, name in TRITON_MODULES.items()}

        def interpreted_impl(name: str):
            module_name, attr = K._TRITON_IMPLS[name]
            return getattr(by_module[module_name], attr)

        monkeypatch.setattr(K, "_triton_impl", interpreted_impl)
        # the dispatcher refuses CPU tensors on the triton backend unless the interpreter is on; these
        # kernels are interpreted, so tell it so (for this test only) without touching the environment
        monkeypatch.setattr(K, "_interpreter_enabled", lambda: True)
    return triton_kernels


@pytest.fixture(params=cpu_linear.isas_here())
def isa(request, monkeypatch):
    """The packed-linear ops (and layers) of the test call the kernel built with each path this CPU runs; test files
    with kernels of their own (quant_linear) define their own `isa`."""
    kernel = cpu_linear.build_cpu_linear(request.param)
    assert kernel is not None
    monkeypatch.setattr(cpu_linear, "cpu_linear_kernel", lambda: kernel)
    return request.param
