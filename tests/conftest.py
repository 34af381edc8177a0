"""Run-wide test settings: the device tensor tests should use, and a guard against Triton's interpreter on CUDA.

On a CUDA machine, engines that leave the compilation level unset run at -O0 (VLSERVE_DEFAULT_COMPILE_LEVEL=0,
unless the run sets it), so the suite's CUDA subset does not compile a model per test; the compilation tests set
their levels themselves. Tests that start a tensor-parallel engine (one rank per GPU) skip on a machine with one GPU.

On a CUDA machine the engine and the kernel tests run the real Triton kernels on the GPU; if
TRITON_INTERPRET were set for the whole run, every `@triton.jit` kernel would be built for the CPU
interpreter instead (slow, and wrong for CUDA tensors), so the run stops with a usage error. On CPU
the kernel tests build their own interpreted copies of the kernels (tests/kernels/_interpreted.py).

Every process a test starts gets the repository root first on its PYTHONPATH, so it imports this checkout's vlserve
and the top-level packages beside it (tests.support, training, benchmarks), wherever it runs from.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [ROOT, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != ROOT)]
)

# what marks a test that starts a tensor-parallel engine (one GPU per rank on CUDA)
_TP_ENGINE_SIGNS = ("tensor_parallel_size=2", '"tensor_parallel_size": 2', '"--tensor-parallel-size", "2"')


def interpreter_requested() -> bool:
    """True when TRITON_INTERPRET is set to something other than empty or 0."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pytest_configure(config):
    if torch.cuda.is_available() and interpreter_requested():
        raise pytest.UsageError(
            "TRITON_INTERPRET is set on a CUDA machine: the Triton kernels would be built for the CPU "
            "interpreter. Unset it; the CPU kernel tests load interpreted kernels by themselves."
        )
    if torch.cuda.is_available():
        os.environ.setdefault("VLSERVE_DEFAULT_COMPILE_LEVEL", "0")


def _starts_tp_engine(item) -> bool:
    if item.get_closest_marker("multi_gpu"):
        return True
    try:
        source = inspect.getsource(item.function)
    except (OSError, TypeError):
        return False
    return any(sign in source for sign in _TP_ENGINE_SIGNS)


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available() or torch.cuda.device_count() >= 2:
        return
    skip = pytest.mark.skip(
        reason="starts a tensor-parallel engine: needs two GPUs (one rank each), this machine has one"
    )
    for item in items:
        if _starts_tp_engine(item):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """cuda when a GPU is present (Triton kernels run for real), else cpu (kernels under the interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
