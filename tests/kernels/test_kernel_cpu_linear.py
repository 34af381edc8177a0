"""The packed bf16 CPU linear (`kernels.cpu_linear`) against float32 math and F.linear, and the layers that use it
(`PackableLinear.pack_for_cpu`, `pack_linears_for_cpu`)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlserve.kernels import cpu_linear as cl
from vlserve.kernels.cpu_linear import cpu_linear, cpu_linear_kernel, cpu_linear_supported, pack_linear_weight
from vlserve.models.parallel_layers import (ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear,
                                            pack_linears_for_cpu)

pytestmark = pytest.mark.skipif(cpu_linear_kernel() is None, reason="this CPU has no AVX512-BF16 (or no toolchain)")


def _operands(m, n, k, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return x, w, b


def _float_reference(x, w, b):
    out = x.float() @ w.float().T
    return out if b is None else out + b.float()


# row counts below, at and past the 8-row block and the 64-row chunk; N below one panel, ragged and whole panels
@pytest.mark.parametrize("m", [1, 3, 8, 13, 64, 130])
@pytest.mark.parametrize("n,k", [(8, 30), (100, 64), (96, 512), (768, 512), (64, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_is_float32_math_rounded_once(m, n, k, bias):
    x, w, b = _operands(m, n, k, bias)
    out = cpu_linear(x, pack_linear_weight(w), b, n)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    want = _float_reference(x, w, b)
    # one rounding to bf16 (half an ulp: 2^-8 relative) plus float32 sums in another order
    torch.testing.assert_close(out.float(), want, rtol=2 ** -8, atol=1e-4)
    # F.linear (oneDNN) rounds the same float32 sums once: the results differ only where the order tips a rounding
    assert (out == F.linear(x, w, b)).float().mean() > 0.97


def test_cpu_linear_takes_strided_and_batched_inputs():
    x, w, b = _operands(24, 64, 96, True)
    packed = pack_linear_weight(w)
    wide = torch.randn(24, 200).to(torch.bfloat16)
    wide[:, 50:146] = x  # rows 200 apart
    view = wide[:, 50:146]
    assert not view.is_contiguous()
    torch.testing.assert_close(cpu_linear(view, packed, b, 64), cpu_linear(x, packed, b, 64), atol=0, rtol=0)
    batched = cpu_linear(x.view(2, 12, 96), packed, b, 64)
    assert batched.shape == (2, 12, 64)
    torch.testing.assert_close(batched.view(24, 64), cpu_linear(x, packed, b, 64), atol=0, rtol=0)
    assert cpu_linear(x[:0], packed, b, 64).shape == (0, 64)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_linear(x.float(), packed, b, 64)


def test_cpu_linear_is_the_same_on_one_thread_and_several():
    x, w, b = _operands(70, 200, 128, True)  # 7 panels: uneven split; 70 rows: two chunks
    packed = pack_linear_weight(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_linear(x, packed, b, 200)
        torch.set_num_threads(max(2, threads))
        several = cpu_linear(x, packed, b, 200)
        few = cpu_linear(x[:, :], pack_linear_weight(w[:20]), b[:20], 20)  # one panel: rows split instead
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, several, atol=0, rtol=0)
    torch.testing.assert_close(few, one[:, :20], atol=0, rtol=0)


def test_pack_layout_and_custom_op():
    w = torch.arange(40 * 4, dtype=torch.float32).view(40, 4).to(torch.bfloat16)
    packed = pack_linear_weight(w)
    assert packed.shape == (2, 2, 32, 2)  # 40 rows -> two panels, the second zero-padded
    assert packed[0, 1, 3].tolist() == w[3, 2:4].tolist()  # panel 0, K pair 1, column 3
    assert packed[1, 0, 7].tolist() == w[39, 0:2].tolist()
    assert packed[1, :, 8:].abs().sum() == 0
    x, w, b = _operands(5, 40, 16, True)
    torch.library.opcheck(cpu_linear, (x, pack_linear_weight(w), b, 40))
    torch.library.opcheck(cpu_linear, (x, pack_linear_weight(w), None, 40))


def test_supported_only_for_cpu_bf16_even_k(monkeypatch):
    assert cpu_linear_supported(torch.zeros(8, 16, dtype=torch.bfloat16))
    assert not cpu_linear_supported(torch.zeros(8, 16))  # float32 keeps oneDNN / MKL
    assert not cpu_linear_supported(torch.zeros(8, 15, dtype=torch.bfloat16))  # K pairs
    monkeypatch.setenv(cl.DISABLE_ENV, "0")
    assert not cpu_linear_supported(torch.zeros(8, 16, dtype=torch.bfloat16))


def test_layers_pack_once_and_compute_the_same():
    torch.manual_seed(0)
    layers = [ColumnParallelLinear(64, 96), MergedColumnParallelLinear(64, {"gate_proj": 48, "up_proj": 48},
                                                                        bias=False), RowParallelLinear(96, 64)]
    model = torch.nn.ModuleList(layers + [torch.nn.Linear(64, 64)]).to(torch.bfloat16)
    x = {64: torch.randn(7, 64).to(torch.bfloat16), 96: torch.randn(7, 96).to(torch.bfloat16)}
    before = [layer(x[layer.in_features]) for layer in layers]
    assert pack_linears_for_cpu(model) == 3  # not the plain nn.Linear
    assert pack_linears_for_cpu(model) == 0  # already packed
    for layer, want in zip(layers, before):
        assert layer.weight is None and layer.packed_weight.shape[1:] == (layer.in_features // 2, 32, 2)
        assert "weight" not in dict(layer.named_parameters()) and "packed_weight" in dict(layer.named_parameters())
        got = layer(x[layer.in_features])
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
    fp32 = ColumnParallelLinear(64, 96)
    assert not fp32.pack_for_cpu() and fp32.weight is not None and fp32.packed_weight is None
