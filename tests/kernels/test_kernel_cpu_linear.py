"""The packed CPU linear (`kernels.cpu_linear`, float32 and bf16) against float32 math and F.linear, its fused
SiLU(gate) * up, and the layers that use them (`PackableLinear.pack_for_cpu`, `pack_linears_for_cpu`, `GatedMLP`).

The kernel tests run on every code path this machine can run (the `isa` fixture: "avx2" on AVX2 CPUs; "avx512" and
the forced "avx2" build on AVX-512 ones), by handing the ops `build_cpu_linear(isa)`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from vlserve.kernels import cpu_linear as cl
from vlserve.kernels.cpu_linear import (
    build_cpu_linear,
    cpu_linear,
    cpu_linear_isa,
    cpu_linear_kernel,
    cpu_linear_silu_mul,
    cpu_linear_supported,
    pack_linear_weight,
)
from vlserve.models.layers import GatedMLP
from vlserve.models.parallel_layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    pack_linears_for_cpu,
)

pytestmark = pytest.mark.skipif(cpu_linear_kernel() is None, reason="no AVX2 + FMA or AVX-512 here (or no toolchain)")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _packed_kernel_at_every_row_count(monkeypatch):
    """These tests check the packed kernel itself: no row count is handed to torch's matmul (on AMX machines bf16
    layers otherwise do so from 8 rows on; tests/kernels/test_onednn_rows.py checks that split)."""
    monkeypatch.setenv("VLSERVE_CPU_ONEDNN_ROWS", "0")


def _operands(m, n, k, bias, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _exact_reference(x, w, b):
    out = x.double() @ w.double().T
    return out if b is None else out + b.double()


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values lie between a and b (bf16 tensors), across zero too."""

    def ordered(t):
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def _assert_one_bf16_rounding(out, x, w, b):
    """out (bf16) is the float32 sum of the bf16 operands rounded once to bf16: at most 1 ulp from the exact sum
    rounded (the float32 sums' order may tip the rounding), or, where the sum cancels, within float32 summation
    error of the exact value."""
    exact = _exact_reference(x, w, b)
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    ok = (_bf16_ulps(out, exact.to(torch.bfloat16)) <= 1) | ((out.double() - exact).abs() <= 1e-5 * scale)
    assert ok.all(), f"{(~ok).sum()} of {ok.numel()} outputs more than an ulp off"


# row counts below, at and past the register blocks (8 rows, 6 or 5 on AVX2) and the row chunks; N below one panel,
# ragged and whole panels; K odd (float32 only: bf16 reads K in pairs, so it takes k + 1), K past one K block and
# not a multiple of it
@pytest.mark.parametrize("m", [1, 3, 5, 7, 8, 13, 64, 130, 300])
@pytest.mark.parametrize(
    "n,k", [(8, 30), (100, 64), (40, 33), (96, 512), (72, 300), (768, 512), (64, 1536), (40, 4100)]
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_linear_is_float32_math(m, n, k, bias, dtype, isa):
    k += k % 2 if dtype == torch.bfloat16 else 0
    x, w, b = _operands(m, n, k, bias, dtype)
    out = cpu_linear(x, pack_linear_weight(w), b, n)
    assert out.shape == (m, n) and out.dtype == dtype
    if dtype == torch.float32:  # float32 sums in another order than oneDNN's
        torch.testing.assert_close(out.double(), _exact_reference(x, w, b), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        return
    _assert_one_bf16_rounding(out, x, w, b)
    # F.linear (oneDNN) rounds the same float32 sums once: the results differ only where the order tips a rounding
    assert (out == F.linear(x, w, b)).float().mean() > 0.97


def test_bf16_on_amx_tiles_rounds_once_and_fuses_silu(monkeypatch):
    if not cl.tile_rows():
        pytest.skip("no AMX tiles in the packed kernel here")
    calls = []
    kernel = cl.cpu_linear_kernel()
    monkeypatch.setattr(cl, "cpu_linear_kernel", lambda: lambda *a: calls.append(a[11]) or kernel(*a))
    for m, n, k in ((2, 100, 64), (17, 96, 512), (33, 40, 1536), (70, 64, 96)):
        x, w, b = _operands(m, n, k, True, seed=m)
        calls.clear()
        out = cpu_linear(x, pack_linear_weight(w), b, n)
        assert calls == [3]  # the tile flag went down
        _assert_one_bf16_rounding(out, x, w, b)
        assert (out == F.linear(x, w, b)).float().mean() > 0.97
        w2, b2 = torch.cat([w[:32], w[:32] * 0.5]), torch.cat([b[:32], -b[:32]])  # gate [32, K], up [32, K]
        fused = cpu_linear_silu_mul(x, pack_linear_weight(w2), b2, 32)
        want = _silu_mul_reference(x, w2, b2, 32)
        torch.testing.assert_close(fused.float(), want.float(), rtol=2**-6, atol=1e-3)
        assert (fused == want).float().mean() > 0.95
    x, w, b = _operands(1, 96, 512, False)
    calls.clear()
    cpu_linear(x, pack_linear_weight(w), b, 96)
    assert calls == [True]  # one row: the register path
    monkeypatch.setenv(cl.TILE_ROWS_ENV, "0")
    cl.tile_rows.cache_clear()
    try:
        assert cl.tile_rows() == 0
    finally:
        monkeypatch.delenv(cl.TILE_ROWS_ENV)
        cl.tile_rows.cache_clear()


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_sums_round_to_nearest_even_once(bias, isa):
    # out[i, j] = 1 * 1 + 1 * t_j (+ b_j) is exact in float32 and lands on and between bf16 values: ties go to even
    t = torch.tensor(
        [
            0,
            2**-8,
            3 * 2**-8,
            2**-9,
            3 * 2**-9,
            2**-7 + 2**-9,
            -(2**-8),
            -3 * 2**-8,
            2**-16,
            -(2**-16),
            1,
            2**-8 + 2**-15,
        ]
        * 4,
        dtype=torch.float32,
    )
    assert torch.equal(t.to(torch.bfloat16).float(), t)  # each t_j a bf16 value, so each sum is exact
    n = len(t)  # 48: a whole panel and a ragged one
    w = torch.stack([torch.ones(n), t], dim=1).to(torch.bfloat16)
    x = torch.ones(7, 2, dtype=torch.bfloat16)
    b = torch.full((n,), 2.0, dtype=torch.bfloat16) if bias else None
    out = cpu_linear(x, pack_linear_weight(w), b, n)
    want = (1 + w[:, 1].float() + (2 if bias else 0)).to(torch.bfloat16).expand(7, n)
    assert torch.equal(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_linear_takes_strided_and_batched_inputs(dtype, isa):
    x, w, b = _operands(24, 64, 96, True, dtype)
    packed = pack_linear_weight(w)
    wide = torch.randn(24, 200).to(dtype)
    wide[:, 50:146] = x  # rows 200 apart
    view = wide[:, 50:146]
    assert not view.is_contiguous()
    torch.testing.assert_close(cpu_linear(view, packed, b, 64), cpu_linear(x, packed, b, 64), atol=0, rtol=0)
    batched = cpu_linear(x.view(2, 12, 96), packed, b, 64)
    assert batched.shape == (2, 12, 64)
    torch.testing.assert_close(batched.view(24, 64), cpu_linear(x, packed, b, 64), atol=0, rtol=0)
    assert cpu_linear(x[:0], packed, b, 64).shape == (0, 64)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):  # inputs in another dtype than the packed weight's
        cpu_linear(x.to(other), packed, b, 64)
    with pytest.raises(ValueError, match="dtype"):
        cpu_linear(x.half(), packed.half(), None, 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_linear_is_the_same_on_one_thread_and_several(dtype, isa):
    x, w, b = _operands(70, 200, 128, True, dtype)  # 7 panels: uneven split; 70 rows: two chunks
    packed = pack_linear_weight(w)
    gate_up = pack_linear_weight(w[:192])
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            runs.append(
                (
                    cpu_linear(x, packed, b, 200),
                    cpu_linear_silu_mul(x, gate_up, b[:192], 96),
                    cpu_linear(x, pack_linear_weight(w[:20]), b[:20], 20),
                )
            )  # one panel: rows split instead
    finally:
        torch.set_num_threads(threads)
    for one, several in zip(*runs):
        torch.testing.assert_close(one, several, atol=0, rtol=0)
    torch.testing.assert_close(runs[0][2], runs[0][0][:, :20], atol=0, rtol=0)


@pytest.mark.parametrize("n,k", [(100, 4100), (64, 4608)])
def test_float32_sums_in_one_order_at_every_row_count(n, k, isa):
    """Many rows (long K walked in blocks, partial sums parked in the output) and one row at a time (one pass over
    K) add the same products in the same order: equal to the bit."""
    x, w, b = _operands(300, n, k, True, torch.float32)
    packed = pack_linear_weight(w)
    whole = cpu_linear(x, packed, b, n)
    rows = torch.cat([cpu_linear(x[i : i + 1], packed, b, n) for i in range(x.shape[0])])
    torch.testing.assert_close(whole, rows, atol=0, rtol=0)


def test_pack_layouts_and_custom_ops(isa):
    w = torch.arange(40 * 4, dtype=torch.float32).view(40, 4)
    for dtype, shape in ((torch.bfloat16, (2, 2, 32, 2)), (torch.float32, (2, 4, 32))):
        packed = pack_linear_weight(w.to(dtype))  # 40 rows -> two panels, the second zero-padded
        assert packed.shape == shape and packed.dtype == dtype
        flat = packed.view(2, 4, 32) if dtype == torch.float32 else packed.permute(0, 1, 3, 2).reshape(2, 4, 32)
        assert flat[0, 2, 3] == w[3, 2] and flat[1, 1, 7] == w[39, 1]  # panel, K position, column
        assert flat[1, :, 8:].abs().sum() == 0
    for dtype in DTYPES:
        x, w, b = _operands(5, 64, 16, True, dtype)
        for op, n in ((cpu_linear, 64), (cpu_linear_silu_mul, 32)):
            torch.library.opcheck(op, (x, pack_linear_weight(w), b, n))
            torch.library.opcheck(op, (x, pack_linear_weight(w), None, n))


def test_supported_dtypes_and_shapes(monkeypatch):
    assert cpu_linear_supported(torch.zeros(8, 16))
    assert cpu_linear_supported(torch.zeros(8, 15))  # float32 takes any K
    assert cpu_linear_supported(torch.zeros(8, 16, dtype=torch.bfloat16))
    assert not cpu_linear_supported(torch.zeros(8, 15, dtype=torch.bfloat16))  # bf16 reads K in pairs
    assert not cpu_linear_supported(torch.zeros(8, 16, dtype=torch.float16))
    assert not cpu_linear_supported(torch.zeros(8, 0))
    assert not cpu_linear_supported(torch.zeros(2, 8, 16))
    monkeypatch.setenv(cl.DISABLE_ENV, "0")
    assert not cpu_linear_supported(torch.zeros(8, 16))


def _silu_mul_reference(x, w, b, i):
    gate, up = F.linear(x, w, b).split(i, dim=-1)
    return F.silu(gate) * up  # rounded as torch rounds: each op's output in the dtype


@pytest.mark.parametrize("m", [1, 5, 7, 8, 21, 64, 70, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_the_gate_up_projection_then_silu_times_up(m, bias, dtype, isa):
    i, k = 96, 136  # three panels of gate, three of up
    x, w, b = _operands(m, 2 * i, k, bias, dtype, seed=m)
    out = cpu_linear_silu_mul(x, pack_linear_weight(w), b, i)
    assert out.shape == (m, i) and out.dtype == dtype
    want = _silu_mul_reference(x, w, b, i)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        gate, up = _exact_reference(x, w, b).split(i, dim=-1)
        torch.testing.assert_close(out.double(), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    else:  # the projection's sums in another order may tip a rounding of gate or up; nothing else differs
        torch.testing.assert_close(out.float(), want.float(), rtol=2**-6, atol=1e-3)
        assert (out == want).float().mean() > 0.95
    batched = cpu_linear_silu_mul(x.view(1, m, k), pack_linear_weight(w), b, i)
    torch.testing.assert_close(batched.view(m, i), out, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_over_the_whole_float_range(dtype, isa):
    # gate = up = x exactly (identity weights): SiLU's exp far past its clamps, where it overflows (silu -> -0) and
    # where it underflows (silu -> x), rounded as torch rounds
    g = torch.tensor(
        [
            -300,
            -104.5,
            -100,
            -89.5,
            -88.5,
            -87,
            -30,
            -1,
            -(2**-20),
            0,
            2**-20,
            0.5,
            1,
            30,
            87,
            88.5,
            89.5,
            100,
            104.5,
            300,
            -5,
            5,
            -0.25,
            0.25,
        ]
        * 8
        + [0] * 32,
        dtype=torch.float32,
    )
    x = g.view(7, 32).to(dtype)  # I = K = 32: 224 gate values
    w = torch.cat([torch.eye(32), torch.eye(32)]).to(dtype)
    out = cpu_linear_silu_mul(x, pack_linear_weight(w), None, 32)
    want = F.silu(x) * x  # torch: -300 / (1 + inf) = -0, 300 / (1 + 0) = 300
    torch.testing.assert_close(out, want, rtol=2e-6 if dtype == torch.float32 else 0, atol=0)
    assert torch.equal(out.float().signbit(), want.float().signbit())


def test_silu_mul_rejects_a_matrix_it_cannot_split():
    x, w, _ = _operands(4, 80, 32, False, torch.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_linear_silu_mul(x, pack_linear_weight(w), None, 40)  # I = 40: gate and up share a panel
    x, w, _ = _operands(4, 96, 32, False, torch.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_linear_silu_mul(x, pack_linear_weight(w), None, 32)  # 3 panels are not gate + up of 32 each


@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_pack_once_and_compute_the_same(dtype, isa):
    torch.manual_seed(0)
    layers = [
        ColumnParallelLinear(64, 96),
        MergedColumnParallelLinear(64, {"gate_proj": 48, "up_proj": 48}, bias=False),
        RowParallelLinear(96, 64),
    ]
    model = torch.nn.ModuleList(layers + [torch.nn.Linear(64, 64)]).to(dtype)
    x = {64: torch.randn(7, 64).to(dtype), 96: torch.randn(7, 96).to(dtype)}
    before = [layer(x[layer.in_features]) for layer in layers]
    assert pack_linears_for_cpu(model) == 3  # not the plain nn.Linear
    assert pack_linears_for_cpu(model) == 0  # already packed
    for layer, want in zip(layers, before):
        panel = (layer.in_features, 32) if dtype == torch.float32 else (layer.in_features // 2, 32, 2)
        assert layer.weight is None and layer.packed_weight.shape[1:] == panel
        assert "weight" not in dict(layer.named_parameters()) and "packed_weight" in dict(layer.named_parameters())
        got = layer(x[layer.in_features])
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-3)
        torch.testing.assert_close(got.float(), want.float(), **tol)
    half = ColumnParallelLinear(64, 96).half()
    assert not half.pack_for_cpu() and half.weight is not None and half.packed_weight is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_mlp_fuses_silu_into_its_packed_gate_up(dtype, isa, monkeypatch):
    torch.manual_seed(0)
    fused, ragged = GatedMLP(64, 96).to(dtype), GatedMLP(64, 40).to(dtype)  # I = 40: no whole panels of gate
    x = torch.randn(9, 64).to(dtype)
    want = {id(mlp): mlp(x) for mlp in (fused, ragged)}
    assert pack_linears_for_cpu(fused) == 2 and pack_linears_for_cpu(ragged) == 2
    calls = []
    real = cl.cpu_linear_silu_mul
    monkeypatch.setattr("vlserve.kernels.packed_linear.cpu_linear_silu_mul", lambda *a: calls.append(a[-1]) or real(*a))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-6, atol=2e-3)
    for mlp in (fused, ragged):
        torch.testing.assert_close(mlp(x).float(), want[id(mlp)].float(), **tol)
    assert calls == [96]  # only the MLP whose gate and up fill whole panels fuses


def test_each_build_reports_the_path_it_was_built_with():
    for isa in cl.isas_here():
        kernel = build_cpu_linear(isa)
        bf16 = "avx2" if isa == "avx512" and not cl._BF16_DOT else isa  # AVX-512 without BF16: bf16 widens on AVX2
        assert (cpu_linear_isa(torch.float32, kernel), cpu_linear_isa(torch.bfloat16, kernel)) == (isa, bf16)
    assert build_cpu_linear("avx512") is None or cl.isas_here()[0] == "avx512"  # never built where it cannot run
    forced = os.environ.get(cl.ISA_ENV) == "avx2"
    assert cpu_linear_isa(torch.float32) == ("avx2" if forced else cl.isas_here()[0])


def test_isa_env_forces_the_avx2_build():
    # a fresh process: the variable is read when the kernel is built, and the kernel itself says which code it runs
    code = "import torch; from vlserve.kernels.cpu_linear import cpu_linear_isa as f; print(f(), f(torch.bfloat16))"
    env = {**os.environ, cl.ISA_ENV: "avx2"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["avx2", "avx2"]
