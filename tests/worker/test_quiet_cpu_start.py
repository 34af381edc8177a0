"""Start-up prints only what a user needs: torch.utils.cpp_extension's "No CUDA runtime is found, using
CUDA_HOME=..." (logged when it is first imported on a machine with a CUDA toolkit and no usable GPU: inductor imports
it to build the C++ CPU kernels) is dropped in every process that builds a model's kernels (each imports
vlserve.executor.worker, which imports kv_sizing, where the filter is installed); its other messages still pass."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

import vlserve.worker.kv_sizing  # noqa: F401  (installs the filter)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_filter_drops_only_the_no_cuda_runtime_line(caplog):
    logger = logging.getLogger("torch.utils.cpp_extension")
    with caplog.at_level(logging.WARNING):
        logger.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local/cuda")
        logger.warning("Error checking compiler version for %s", "c++")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["Error checking compiler version for c++"]


def _import_cpp_extension(tmp_path, prelude: str) -> str:
    """stderr of a fresh interpreter that imports torch.utils.cpp_extension after `prelude`, on a machine that looks
    CPU-only with a CUDA toolkit (CUDA_HOME set, no visible GPU)."""
    env = {**os.environ, "CUDA_HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}
    code = f"{prelude}\nimport torch.utils.cpp_extension\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


@pytest.mark.slow
def test_a_cpu_process_that_loads_vlserve_does_not_print_it(tmp_path):
    plain = _import_cpp_extension(tmp_path, "import torch")
    if "No CUDA runtime is found" not in plain:
        pytest.skip("this torch does not print the warning here (a CPU-only build of torch)")
    quiet = _import_cpp_extension(tmp_path, "import vlserve.executor.worker")
    assert "No CUDA runtime is found" not in quiet, quiet[-2000:]
