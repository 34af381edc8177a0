"""The C++ CPU RMSNorm (with its residual add) and SiLU-and-mul against the torch ops they replace: the residual sum
bit-equal, norms equal but for an occasional one-step difference (the order of the float32 sum of squares: a bf16
step, or float32's last bits); silu-and-mul equal in bf16 and within an ulp in float32 (torch's scalar
tail); what falls back; and the model layers taking them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.test_quick_gelu_cpu import assert_equal_but_below_normals, every_bf16
from vlserve.kernels.rms_norm_cpu import DISABLE_ENV as NORM_ENV
from vlserve.kernels.rms_norm_cpu import rms_norm, rms_norm_cpu_kernel
from vlserve.kernels.silu_mul_cpu import DISABLE_ENV as SILU_ENV
from vlserve.kernels.silu_mul_cpu import silu_mul, silu_mul_cpu_kernel
from vlserve.models.gemma3 import GemmaRMSNorm
from vlserve.models.layers import GatedMLP, RMSNorm

pytestmark = pytest.mark.skipif(
    rms_norm_cpu_kernel() is None or silu_mul_cpu_kernel() is None, reason="no C++ toolchain for these kernels here"
)
SHAPES = [(1, 1536), (7, 100), (33, 896), (130, 64), (3, 17)]


def _norm_case(seed, tokens, hidden, dtype):
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, eps=1e-6).to(dtype)
    norm.weight.data = (torch.randn(hidden, generator=g) * 0.5 + 1).to(dtype)
    x = (torch.randn(tokens, hidden, generator=g) * 3).to(dtype)
    residual = (torch.randn(tokens, hidden, generator=g) * 3).to(dtype)
    return norm, x, residual


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_rms_norm_matches_torch(shape, dtype):
    norm, x, residual = _norm_case(shape[0], *shape, dtype)
    want_sum = residual + x
    _close(rms_norm(x, norm.weight, norm.eps), norm._norm(x), dtype)
    got, got_sum = rms_norm(x, norm.weight, norm.eps, residual)
    assert torch.equal(got_sum, want_sum)
    _close(got, norm._norm(want_sum), dtype)


def _close(got, want, dtype):
    if dtype is torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        return
    # at most one bf16 step apart, and on a small fraction of the values
    step = want.float().abs().clamp_min(1e-30) * 2**-7
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= step).all())
    assert (diff > 0).float().mean().item() < 0.01


@torch.no_grad()
def test_rms_norm_layer_takes_the_kernel_and_gemma_does_not(monkeypatch):
    norm, x, residual = _norm_case(1, 9, 64, torch.bfloat16)
    fused, fused_sum = norm(x, residual)
    monkeypatch.setenv(NORM_ENV, "0")
    plain, plain_sum = norm(x, residual)
    assert torch.equal(fused_sum, plain_sum)
    _close(fused, plain, torch.bfloat16)
    monkeypatch.delenv(NORM_ENV)
    gemma = GemmaRMSNorm(64).to(torch.bfloat16)
    gemma.weight.data = torch.randn(64).to(torch.bfloat16)
    assert torch.equal(gemma(x), gemma._norm(x))  # Gemma's (1 + weight) arithmetic stays on torch


@torch.no_grad()
def test_float32_norms_stay_on_torch_where_marked(monkeypatch):
    norm, x, residual = _norm_case(3, 9, 64, torch.float32)
    calls = []
    monkeypatch.setattr("vlserve.models.layers.rms_norm", lambda *a: calls.append(a) or None)
    norm(x, residual)
    assert len(calls) == 1
    norm.float32_on_torch = True  # what activation quantization sets
    got, got_sum = norm(x, residual)
    assert len(calls) == 1
    assert torch.equal(got, norm._norm(residual + x)) and torch.equal(got_sum, residual + x)
    norm(x.bfloat16(), residual.bfloat16())  # bf16 rows still take the kernel
    assert len(calls) == 2


@torch.no_grad()
def test_rms_norm_refuses_what_it_does_not_take():
    norm, x, _ = _norm_case(2, 4, 32, torch.bfloat16)
    assert rms_norm(x, norm.weight, norm.eps) is not None
    assert rms_norm(x.t().contiguous().t(), norm.weight, norm.eps) is None  # not contiguous
    assert rms_norm(x.view(2, 2, 32), norm.weight, norm.eps) is None  # not [T, H]
    assert rms_norm(x, norm.weight.float(), norm.eps) is None  # weight of another dtype
    assert rms_norm(x.float(), norm.weight.float(), norm.eps) is not None
    assert rms_norm(x.half(), norm.weight.half(), norm.eps) is None
    with torch.enable_grad():
        assert rms_norm(x, norm.weight, norm.eps) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, inter", [(1, 8), (5, 37), (64, 896), (3, 100)])
@torch.no_grad()
def test_silu_mul_matches_torch(dtype, tokens, inter):
    g = torch.Generator().manual_seed(tokens * inter)
    gate_up = (torch.randn(tokens, 2 * inter, generator=g) * 4).to(dtype)
    gate, up = gate_up.split(inter, dim=-1)
    want = F.silu(gate) * up
    got = silu_mul(gate_up, inter)
    if dtype is torch.bfloat16:
        assert torch.equal(got, want)
    else:  # torch's scalar tail loop takes libm's exp
        torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-30)
    wide = torch.randn(tokens, 2 * inter + 6, generator=g).to(dtype)[:, : 2 * inter]  # strided rows
    gate, up = wide.split(inter, dim=-1)
    torch.testing.assert_close(silu_mul(wide, inter), F.silu(gate) * up, rtol=4e-7, atol=1e-30)


@torch.no_grad()
def test_silu_mul_over_every_bf16_gate():
    gate = every_bf16()
    up = torch.linspace(-3, 3, gate.numel()).to(torch.bfloat16)
    gate_up = torch.cat([gate, up]).view(1, -1)
    assert_equal_but_below_normals(silu_mul(gate_up, gate.numel())[0], F.silu(gate) * up)


@torch.no_grad()
def test_gated_mlp_takes_silu_mul(monkeypatch):
    torch.manual_seed(0)
    mlp = GatedMLP(32, 48).to(torch.bfloat16)  # unpacked: the projection, then the kernel
    x = torch.randn(200, 32, dtype=torch.bfloat16)
    fused = mlp(x)
    monkeypatch.setenv(SILU_ENV, "0")
    assert torch.equal(fused, mlp(x))
    assert silu_mul(torch.randn(4, 10), 5) is None  # switched off: the caller runs torch
