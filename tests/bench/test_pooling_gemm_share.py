"""benchmarks.linear_flops' FLOP count of the linears, read from the profiler's recorded shapes, and
benchmarks.cpu_peak's probe."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.cpu_peak import peak_gflops
from benchmarks.linear_flops import profile_linears
from vlserve.kernels.cpu_linear import (
    cpu_linear,
    cpu_linear_kernel,
    cpu_linear_silu,
    cpu_linear_silu_mul,
    pack_linear_weight,
)


def _profiled_flops(fn) -> int:
    counted = profile_linears(fn)
    assert counted["result"] is not None and counted["wall_s"] >= counted["linear_s"] >= 0
    return round(counted["linear_gflop"] * 1e9)


def test_torch_linears_count_two_flops_per_multiply_add():
    x, w, b = torch.randn(2, 5, 12), torch.randn(7, 12), torch.randn(7)
    assert _profiled_flops(lambda: F.linear(x[0], w, b)) == 2 * 5 * 12 * 7  # addmm
    assert _profiled_flops(lambda: F.linear(x, w)) == 2 * 10 * 12 * 7  # a batch: mm on the flattened rows
    assert _profiled_flops(lambda: x @ torch.randn(12, 3)) == 2 * 10 * 12 * 3


@pytest.mark.skipif(cpu_linear_kernel() is None, reason="no packed CPU linear here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linears_count_their_padded_panels(dtype):
    x = torch.randn(3, 4, 64).to(dtype)
    packed = pack_linear_weight(torch.randn(96, 64).to(dtype))
    assert _profiled_flops(lambda: cpu_linear(x, packed, None, 96)) == 2 * 12 * 64 * 96
    assert _profiled_flops(lambda: cpu_linear_silu(x, packed, None, 96)) == 2 * 12 * 64 * 96
    # gate and up: 2 x 32 columns of output 32
    assert _profiled_flops(
        lambda: cpu_linear_silu_mul(x, pack_linear_weight(torch.randn(64, 64).to(dtype)), None, 32)
    ) == (2 * 12 * 64 * 64)


def test_peak_probe_reports_a_rate():
    rate = peak_gflops("float32", threads=1, iters=200_000)
    assert rate is not None and rate > 1.0
    bf16 = peak_gflops("bfloat16", threads=1, iters=200_000)
    assert (bf16 is None) == (not torch.cpu._is_avx512_bf16_supported())
