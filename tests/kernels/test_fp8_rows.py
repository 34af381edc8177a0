"""FP8 linears with dynamic per-token (or static) activation scales treat every row on its own: row i of a call on
M stacked rows equals the call on that row alone, bit for bit, whatever M (1-2 row decode path, register blocks,
AMX tiles) and wherever the row sits; and the activations are rounded as compressed-tensors defines it (scale
absmax / 448 in float32 per token, `x / scale` clamped to +-448 and cast with torch's `.to(torch.float8_e4m3fn)`)."""

from __future__ import annotations

import pytest
import torch

from vlserve.kernels import cpu_linear
from vlserve.kernels import quant_linear as QL
from vlserve.kernels import quant_linear_cpu as QC
from vlserve.kernels.kv_quant import FP8_MAX

pytestmark = pytest.mark.skipif(QC.quant_kernel() is None, reason="no AVX2 + FMA or AVX-512 here (or no toolchain)")
BATCHES = [(2, 0), (3, 5), (7, 1), (8, 0), (8, 13), (9, 4), (16, 2), (17, 20), (33, 3), (40, 0)]  # (rows, first)


@pytest.fixture(params=cpu_linear.isas_here())
def isa(request, monkeypatch):
    kernel = QC.build_quant_linear(request.param)
    assert kernel is not None
    monkeypatch.setattr(QC, "quant_kernel", lambda: kernel)
    return request.param


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def compressed_tensors_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> float32 [M, K]: compressed-tensors' dynamic per-token FP8 quantize-dequantize in float32."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX  # [M, 1]
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def _weights(n: int, k: int, kind: str, act: str) -> QL.FP8Weights:
    """An FP8 [N, K] matrix whose second half of the columns repeats the first (see `_cancelling_rows`)."""
    g = _gen(n + k)
    w = (torch.randn(n, k // 2, generator=g) * 0.05).repeat(1, 2)
    if kind == "channel":
        scale = w.abs().amax(-1) / FP8_MAX  # [N]
        q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        block = None
    else:  # 32 x 64 blocks: scales along K, the register kernel only
        block = (32, 64)
        scale = torch.rand(-(-n // 32), -(-k // 64), generator=g) * 1e-3 + 1e-4
        q = (w / 1e-3).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QL.prepare_fp8(q, scale, block, act, 0, torch.tensor(0.02) if act == "static" else None)


def _cancelling_rows(m: int, k: int) -> torch.Tensor:
    """x [M, K] = [a, -a + noise] with rows of different magnitudes: against `_weights` the two halves' sums nearly
    cancel, so a difference in how a path rounds its float32 sums shows in the (bf16) output."""
    g = _gen(3)
    a = torch.randn(m, k // 2, generator=g)
    return torch.cat([a, -a + 0.05 * torch.randn(m, k // 2, generator=g)], 1) * torch.logspace(-2, 1, m)[:, None]


@pytest.mark.parametrize("amx_rows_env", [None, "8", "0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,act", [("channel", "token"), ("channel", "static"), ("block", "token")])
def test_rows_of_a_batch_equal_the_rows_alone(kind, act, dtype, amx_rows_env, isa, monkeypatch):
    """Whatever path the row count picks (AMX tiles where this CPU has them, `VLSERVE_QUANT_AMX_ROWS` set or
    not), each row of the batched output equals the one-row call on it exactly."""
    if amx_rows_env is None:
        monkeypatch.delenv(QC.AMX_ROWS_ENV, raising=False)
    else:
        monkeypatch.setenv(QC.AMX_ROWS_ENV, amx_rows_env)
    n, k = 96, 320
    w = _weights(n, k, kind, act)
    assert w.cpu is not None
    x = _cancelling_rows(64, k).to(dtype)
    bias = torch.randn(n, generator=_gen(4)) * 1e-3  # small: the sums' rounding stays visible
    alone = torch.cat([QL.fp8_linear(x[i : i + 1], w, bias) for i in range(64)])  # [64, N]
    worst = {}
    for rows, first in BATCHES:
        got = QL.fp8_linear(x[first : first + rows], w, bias)
        worst[rows] = float((got.float() - alone[first : first + rows].float()).abs().max())
    assert all(d == 0 for d in worst.values()), f"max |batched - alone| by rows: {worst}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_rounding_equals_compressed_tensors(dtype, isa):
    """W = I: the kernel's output is x as it rounded it through e4m3, on every row-count path: compressed-tensors'
    per-token rounding exactly (values across e4m3's normal and subnormal ranges, ties, the clamp)."""
    k = 256
    g = _gen(5)
    x = torch.randn(48, k, generator=g) * torch.logspace(-6, 3, 48)[:, None]
    x *= torch.where(torch.rand(48, k, generator=g) < 0.2, 1e-3, 1.0)  # values deep in the row's subnormal range
    x[0, :6] = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 2**-10, 3 * 2**-10])  # scale 1: ties to even
    x[1] = 0.0  # an all-zero row
    x = x.to(dtype)
    want = compressed_tensors_fake_quant(x)
    assert torch.equal(QL.quantize_fp8_ref(x, "token"), want)
    eye = QL.prepare_fp8(torch.eye(k).to(torch.float8_e4m3fn), torch.ones(k), None, "token")
    for rows in (1, 2, 5, 16, 48):
        got = torch.cat([QL.fp8_linear(x[i : i + rows], eye, None) for i in range(0, 48, rows)])
        assert torch.equal(got, want.to(dtype)), f"{rows} rows a call"


def test_reference_equals_compressed_tensors_fake_quantize():
    """`quantize_fp8_ref` equals compressed-tensors' own dynamic token `fake_quantize` on float32 activations (as
    transformers runs it: [batch, seq, hidden], one scale per token)."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    args = ct.QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
    x = torch.randn(2, 24, 128, generator=_gen(6)) * torch.logspace(-4, 2, 24)[None, :, None]
    scale, zero = compute_dynamic_scales_and_zp(x, args, module=torch.nn.Linear(1, 1))
    want = fake_quantize(x, scale, zero, args)
    assert torch.equal(QL.quantize_fp8_ref(x.reshape(-1, 128), "token"), want.reshape(-1, 128))
