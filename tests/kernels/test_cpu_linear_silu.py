"""`cpu_linear_silu`: SiLU in the packed kernel's epilogue equals the projection then `F.silu` (each output rounded
to the dtype, activated, rounded again); a folded quick-GELU MLP (`VisionMLP`) runs its fc1 through it. Run on every
code path this machine can run (the `isa` fixture), and on the AMX tiles where the CPU has them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlserve.kernels import cpu_linear as cl
from vlserve.kernels.cpu_linear import cpu_linear, cpu_linear_kernel, cpu_linear_silu, pack_linear_weight

pytestmark = pytest.mark.skipif(cpu_linear_kernel() is None, reason="no AVX2 + FMA or AVX-512 here (or no toolchain)")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _packed_kernel_at_every_row_count(monkeypatch):
    monkeypatch.setenv("VLSERVE_CPU_ONEDNN_ROWS", "0")


def _operands(m, n, k, bias, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 2 / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


# rows below, at and past the register blocks (8; 6 or 5 on AVX2) and the row chunks; N ragged, one and several
# panels; K past one K block and long enough for the float32 K-blocked walk (which the epilogue does not take)
@pytest.mark.parametrize("m", [1, 3, 8, 13, 130, 300])
@pytest.mark.parametrize("n,k", [(40, 33), (96, 512), (3072, 64), (64, 4100)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_epilogue_is_the_projection_then_silu(m, n, k, bias, dtype, isa):
    if dtype == torch.bfloat16 and k % 2:
        k += 1
    x, w, b = _operands(m, n, k, bias, dtype, seed=m + n)
    packed = pack_linear_weight(w)
    out = cpu_linear_silu(x, packed, b, n)
    assert out.shape == (m, n) and out.dtype == dtype
    want = F.silu(cpu_linear(x, packed, b, n))  # the same sums, rounded to the dtype, then torch's silu
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=2e-6, atol=1e-7)
    else:  # our exp and torch's may differ in float32's last bits; the bf16 rounding hides nearly all of it
        torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=1e-6)
        assert (out == want).float().mean() > 0.99
    batched = cpu_linear_silu(x.view(1, m, k), packed, b, n)
    torch.testing.assert_close(batched.view(m, n), out, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_epilogue_over_the_whole_float_range(dtype, isa):
    # the identity matrix: the outputs are x itself, far past exp's clamps (silu -> -0 below, -> x above)
    values = [-300, -104.5, -89.5, -88.5, -87, -30, -1, -(2**-20), 0, 2**-20, 0.5, 1, 30, 87, 88.5, 89.5, 104.5, 300]
    x = torch.tensor((values * 2)[:32] * 4, dtype=torch.float32).view(4, 32).to(dtype)
    out = cpu_linear_silu(x, pack_linear_weight(torch.eye(32).to(dtype)), None, 32)
    want = F.silu(x)
    torch.testing.assert_close(out, want, rtol=2e-6 if dtype == torch.float32 else 0, atol=0)
    assert torch.equal(out.float().signbit(), want.float().signbit())


@pytest.mark.skipif(not cl.tile_rows(), reason="the packed kernel has no AMX tiles here")
def test_silu_epilogue_on_amx_tiles(monkeypatch):
    x, w, b = _operands(300, 96, 128, True, torch.bfloat16)
    packed = pack_linear_weight(w)
    out = cpu_linear_silu(x, packed, b, 96)  # 300 rows >= tile_rows(): the tiles
    want = F.silu(cpu_linear(x, packed, b, 96))
    torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=1e-6)
    assert (out == want).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
def test_folded_quick_gelu_mlp_runs_fc1_through_the_epilogue(dtype, isa, monkeypatch):
    from vlserve.encoders.vision_layers import VisionMLP
    from vlserve.kernels.packed_linear import pack_linears_for_cpu

    class Cfg:
        width, mlp_hidden, hidden_act = 64, 160, "quick_gelu"

    torch.manual_seed(0)
    mlp = VisionMLP(Cfg()).to(dtype)
    x = torch.randn(37, 64).to(dtype)
    with torch.no_grad():
        unfolded = mlp(x)
        assert mlp.fold_quick_gelu()
        pack_linears_for_cpu(mlp)
        assert mlp.fc1.weight is None  # packed: the kernel's path
        calls = []
        real = cl.cpu_linear_silu
        monkeypatch.setattr("vlserve.kernels.packed_linear.cpu_linear_silu", lambda *a: calls.append(1) or real(*a))
        folded = mlp(x)
    assert calls == [1]
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=5e-2, atol=2e-2)
    torch.testing.assert_close(folded.float(), unfolded.float(), **tol)
