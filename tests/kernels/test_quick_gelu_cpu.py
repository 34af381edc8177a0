"""The one-pass C++ quick-GELU (`kernels.quick_gelu_cpu`) against the three torch ops it replaces: equal bf16 values
and float32 within an ulp, on lengths off the vector width, large and small magnitudes and non-finite inputs; what falls back
to torch; and the activation table taking it."""

from __future__ import annotations

import pytest
import torch

from vlserve.kernels.activation import activation
from vlserve.kernels.quick_gelu_cpu import DISABLE_ENV, quick_gelu, quick_gelu_cpu_kernel, quick_gelu_ref

pytestmark = pytest.mark.skipif(quick_gelu_cpu_kernel() is None, reason="no C++ toolchain for the CPU quick-GELU here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 7, 31, 33, 4095, 4097, 1024 * 1280 + 5])
def test_equal_to_the_torch_ops(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    x = (torch.randn(numel, generator=g) * 6).to(dtype)
    if dtype is torch.bfloat16:
        assert torch.equal(quick_gelu(x), quick_gelu_ref(x))
    else:  # torch's scalar tail loop takes libm's exp, an ulp away from the vector exp at times
        torch.testing.assert_close(quick_gelu(x), quick_gelu_ref(x), rtol=4e-7, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extremes_and_non_finite(dtype):
    x = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 60.0, -60.0, 1e4, -1e4, float("inf"), -float("inf"), float("nan")])
    x = x.repeat(5).to(dtype)  # 55 values: the vector loop and its tail
    got, want = quick_gelu(x), quick_gelu_ref(x)
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    torch.testing.assert_close(got[finite], want[finite], rtol=4e-7 if dtype is torch.float32 else 0, atol=0)


def every_bf16() -> torch.Tensor:
    """Every bf16 value but the NaNs, in bit order."""
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return values[~values.isnan()]


def assert_equal_but_below_normals(got: torch.Tensor, want: torch.Tensor) -> None:
    """got == want everywhere but where the exact result went through a float32 denormal: there got is 0 and want
    tiny (csrc/vec_bf16.h: the one-instruction rounding flushes those)."""
    assert torch.equal(got.isnan(), want.isnan())
    differ = (got != want) & ~want.isnan()
    assert (got[differ] == 0).all() and (want[differ].float().abs() < 1e-35).all(), want[differ][:8]


def test_every_bf16_input():
    x = every_bf16()
    assert_equal_but_below_normals(quick_gelu(x), quick_gelu_ref(x))


def test_keeps_shape_and_leaves_input_alone():
    x = torch.randn(4, 5, 6, dtype=torch.bfloat16)
    before = x.clone()
    y = quick_gelu(x)
    assert y.shape == x.shape and y.dtype == x.dtype and y.data_ptr() != x.data_ptr()
    assert torch.equal(x, before)


def test_strided_and_other_dtypes_take_torch(monkeypatch):
    x = torch.randn(8, 6)[:, ::2]  # not contiguous
    assert torch.equal(quick_gelu(x), quick_gelu_ref(x))
    h = torch.randn(10, dtype=torch.float16)
    assert torch.equal(quick_gelu(h), quick_gelu_ref(h))
    monkeypatch.setenv(DISABLE_ENV, "0")
    y = torch.randn(100)
    assert torch.equal(quick_gelu(y), quick_gelu_ref(y))


def test_activation_table_uses_it():
    assert activation("quick_gelu") is quick_gelu
