"""The CPU kernel tests' interpreter stays theirs: no run-wide TRITON_INTERPRET, CUDA tensors on a GPU."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest
import torch
from _interpreted import INTERPRET_ENV, TRITON_MODULES, USER_INTERPRET_VALUE, _import_fresh, interpreted_triton_modules
from _kernel_testutils import to_device

TESTS_DIR = pathlib.Path(__file__).resolve().parents[1]


def _write_case():
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(3, 2, 64, generator=g), torch.randn(3, 2, 64, generator=g)
    k_cache, v_cache = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
    return key, value, k_cache, v_cache, torch.tensor([0, 21, -1])


def test_interpreted_copies_leave_no_trace():
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    call_before = JITFunction.__call__
    copies = interpreted_triton_modules()
    key, value, k_cache, v_cache, slots = _write_case()
    copies.kv_write.write_kv_cache_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[1, 5], key[1]) and torch.equal(v_cache[0, 0], value[0])  # the kernel really ran
    assert isinstance(copies.attention._decode_kernel, InterpretedFunction)

    # the process: environment as the user left it, triton's patch undone, no copy in sys.modules
    assert os.environ.get(INTERPRET_ENV) == USER_INTERPRET_VALUE
    assert JITFunction.__call__ is call_before
    for short, name in TRITON_MODULES.items():
        assert sys.modules.get(name) is not getattr(copies, short)
    if USER_INTERPRET_VALUE in (None, "", "0"):
        import triton.language as tl

        assert isinstance(tl.zeros, JITFunction)  # triton's own library stays compiled-mode
        fresh = _import_fresh([TRITON_MODULES["kv_write"]])[TRITON_MODULES["kv_write"]]
        assert isinstance(fresh._write_kv_kernel, JITFunction)  # a normal import builds GPU kernels


def test_no_test_sets_interpreter_for_the_run():
    # setting the variable at import or collection would make every CUDA test run interpreted kernels
    var = "TRITON_" + "INTERPRET"
    patterns = [
        f'os.environ["{var}"]',
        f"os.environ['{var}']",
        f'setdefault("{var}"',
        f"setdefault('{var}'",
        f'putenv("{var}"',
    ]
    offenders = [
        f"{path.relative_to(TESTS_DIR)}: {pattern}"
        for path in TESTS_DIR.rglob("*.py")
        for pattern in patterns
        if pattern in path.read_text()
    ]
    assert not offenders


def test_cuda_run_refuses_interpreter(monkeypatch):
    spec = importlib.util.spec_from_file_location("tests_root_conftest", TESTS_DIR / "conftest.py")
    root_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root_conftest)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv(INTERPRET_ENV, "1")
    with pytest.raises(pytest.UsageError, match="TRITON_INTERPRET is set on a CUDA machine"):
        root_conftest.pytest_configure(None)
    monkeypatch.setenv(INTERPRET_ENV, "0")
    monkeypatch.setenv("VLSERVE_DEFAULT_COMPILE_LEVEL", "")  # recorded, so what a CUDA run sets is undone after
    monkeypatch.delenv("VLSERVE_DEFAULT_COMPILE_LEVEL")
    root_conftest.pytest_configure(None)
    assert os.environ["VLSERVE_DEFAULT_COMPILE_LEVEL"] == "0"  # a CUDA run's engines default to -O0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_tests_use_cuda_tensors_and_compiled_kernels(device, triton_kernels):
    from triton.runtime.jit import JITFunction

    assert device.type == "cuda"
    assert isinstance(triton_kernels.kv_write._write_kv_kernel, JITFunction)
    key, value, k_cache, v_cache, slots = to_device(device, *_write_case())
    assert all(t.is_cuda for t in (key, value, k_cache, v_cache, slots))
    triton_kernels.kv_write.write_kv_cache_triton(key, value, k_cache, v_cache, slots)
    assert k_cache.is_cuda and torch.equal(k_cache[1, 5].cpu(), key[1].cpu())
