"""The C++ CPU kernels of the quantized linears (`kernels.quant_linear_cpu`, reached through `quant_linear`'s
`prepare_*` / `*_linear`) against their float32 `*_ref` twins: WNA16 (4 and 8 bits, groups of 32/64/128 and per
channel, act order, asymmetric zeros) and FP8 (per-tensor / per-channel / block scales, dynamic per-token / per-group
and static activations) to float32 rounding, W8A8 INT8 exactly (the same int32 sums and float32 rescale).

Rows cover the fused decode path (1-2 rows), the dequantize-a-block path (3+ rows, register-block tails) and more
than one chunk of rows; N ragged and whole panels; K not a multiple of 8 where the scheme allows it. The tests run on
every build this machine can run (the `isa` fixture: "avx2" on AVX2 CPUs; "avx512" and "avx2" on AVX-512 ones)."""

from __future__ import annotations

import pytest
import torch

from vlserve.kernels import cpu_linear
from vlserve.kernels import quant_linear as QL
from vlserve.kernels import quant_linear_cpu as QC

pytestmark = pytest.mark.skipif(QC.quant_kernel() is None, reason="no AVX2 + FMA or AVX-512 here (or no toolchain)")
ROWS = [1, 2, 5, 13, 100]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=cpu_linear.isas_here())
def isa(request, monkeypatch):
    """prepare_* pack for, and the ops call, the kernel built for this path."""
    kernel = QC.build_quant_linear(request.param)
    assert kernel is not None
    monkeypatch.setattr(QC, "quant_kernel", lambda: kernel)
    return request.param


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _check(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    """out and ref agree to float32 rounding: within 1e-5 of `bound` (sum of |products| + |bias|, float64), plus one
    rounding to the output dtype where that is not float32."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    diff = (out.double() - ref.double()).abs()
    tol = 1e-5 * bound.reshape(diff.shape) + 1e-7
    if out.dtype != torch.float32:
        tol = tol + ref.double().abs() * torch.finfo(out.dtype).eps
    assert (diff <= tol).all(), f"{int((diff > tol).sum())} of {diff.numel()} off; worst {float((diff - tol).max())}"


def _bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).double()
    out = x2.abs() @ w.double().abs().T
    return out if b is None else out + b.double().abs()


# ----------------------------------------------------------------------------------------------------- WNA16


def _wna16(n: int, k: int, group: int | None, bits: int, act_order: bool, seed: int = 0):
    """Canonical operands: q [N, K], fp16 scales [N, G], zeros [N, G] and g_idx (act order) or None."""
    g = _gen(seed)
    gs = group or k
    groups = -(-k // gs)
    q = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=g) * 0.02 + 1e-3).half()
    zeros = torch.randint(0, 2**bits, (n, groups), generator=g, dtype=torch.uint8)
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // gs)[torch.randperm(k, generator=g)]
    return q, scales, zeros, gs, g_idx


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group,n,k", [(32, 72, 96), (64, 100, 192), (128, 64, 384), (None, 40, 100), (None, 33, 37)])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_wna16_matches_reference(bits, group, n, k, act_order, m, dtype, isa):
    q, scales, zeros, gs, g_idx = _wna16(n, k, group, bits, act_order and group is not None)
    w = QL.prepare_wna16(q, scales, zeros, gs, bits, g_idx)
    assert w.cpu is not None  # packed
    g = _gen(1)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g) if m % 2 else None
    out = QL.wna16_linear(x, w, b)
    tiles = _on_tiles(w, x)  # the AMX path multiplies the weights rounded to bf16, as its reference twin states
    weight_dtype = torch.bfloat16 if tiles else torch.float32
    ref = QL.wna16_linear_ref(x, q, scales, zeros, gs, g_idx, b, weight_dtype)
    _check(out, ref, _bound(x, QL.dequantize_wna16_ref(q, scales, zeros, gs, g_idx).to(weight_dtype), b))


def _on_tiles(w, x) -> bool:
    """Whether this WNA16 call runs on the AMX tiles (bf16 x of at least the packed matrix's row threshold)."""
    return bool(w.cpu.amx_rows) and x.dtype is torch.bfloat16 and x.numel() // x.shape[-1] >= w.cpu.amx_rows


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_wna16_amx_tiles_match_the_bf16_weight_reference(bits, scale_dtype, monkeypatch):
    kernel = QC.build_quant_linear("avx512")
    if kernel is None or not QC.quant_kernel_info(kernel)["amx"]:
        pytest.skip("no AMX build here")
    monkeypatch.setattr(QC, "quant_kernel", lambda: kernel)
    monkeypatch.setenv(QC.AMX_ROWS_ENV, "3")
    # 4 bits: group 8 on the dequantizing tile path, the others by table lookup (one block of 16 or 32 rows, or
    # several); K 1000 not a whole number of tile steps
    for n, k, group, m in (
        (72, 96, 32, 3),
        (100, 200, 8, 40),
        (600, 448, 64, 33),
        (64, 1000, None, 16),
        (90, 320, 64, 24),
    ):
        q, scales, zeros, gs, _ = _wna16(n, k, group, bits, False, seed=n)
        scales = scales.to(scale_dtype)
        w = QL.prepare_wna16(q, scales, zeros, gs, bits)
        assert w.cpu.amx_rows == 3
        x = torch.randn(m, k, generator=_gen(m)).bfloat16()
        b = torch.randn(n, generator=_gen(n))
        assert _on_tiles(w, x)
        ref = QL.wna16_linear_ref(x, q, scales, zeros, gs, None, b, torch.bfloat16)
        wb = QL.dequantize_wna16_ref(q, scales, zeros, gs).bfloat16()
        _check(QL.wna16_linear(x, w, b), ref, _bound(x, wb, b))
        below = x[:2]  # under the threshold: the register kernel, float32 weights
        _check(
            QL.wna16_linear(below, w, b),
            QL.wna16_linear_ref(below, q, scales, zeros, gs, None, b),
            _bound(below, QL.dequantize_wna16_ref(q, scales, zeros, gs), b),
        )


def test_amx_rows_policy(monkeypatch):
    monkeypatch.delenv(QC.AMX_ROWS_ENV, raising=False)
    built = QC.quant_kernel_info()["amx"]
    assert QC.amx_rows() == (QC.AMX_ROWS if built else None)
    monkeypatch.setenv(QC.AMX_ROWS_ENV, "0")
    assert QC.amx_rows() is None
    monkeypatch.setenv(QC.AMX_ROWS_ENV, "x")
    with pytest.raises(ValueError, match="VLSERVE_QUANT_AMX_ROWS"):
        QC.amx_rows()


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_wna16_scale_dtypes_and_shapes(scale_dtype, isa):
    # float32 / bf16 scales kept as stored; x [2, 3, K] in float16 (through float32); a checkpoint with more groups
    # than K needs
    q, scales, zeros, gs, _ = _wna16(96, 128, 32, 4, False)
    scales = torch.cat([scales, scales[:, :1]], 1).to(scale_dtype)  # [N, 5]: one group more than K has
    zeros = torch.cat([zeros, zeros[:, :1]], 1)
    w = QL.prepare_wna16(q, scales, zeros, gs, 4)
    x = torch.randn(2, 3, 128, generator=_gen(2)).half()
    out = QL.wna16_linear(x, w, None)
    ref = QL.wna16_linear_ref(x, q, scales[:, :4], zeros[:, :4], gs, None, None)
    assert out.shape == (2, 3, 96)
    _check(out, ref, _bound(x, QL.dequantize_wna16_ref(q, scales[:, :4], zeros[:, :4], gs), None).reshape(2, 3, 96))


def test_wna16_unpackable_groups_keep_the_reference(isa):
    q, scales, zeros, gs, _ = _wna16(16, 48, 12, 4, False)  # groups of 12: not whole lanes of 8 positions
    w = QL.prepare_wna16(q, scales, zeros, gs, 4)
    assert w.cpu is None
    x = torch.randn(3, 48, generator=_gen(3))
    torch.testing.assert_close(QL.wna16_linear(x, w, None), QL.wna16_linear_ref(x, q, scales, zeros, gs, None, None))


# ----------------------------------------------------------------------------------------------------- W8A8 INT8


@pytest.mark.parametrize("n,k", [(40, 33), (96, 512), (72, 300), (64, 1536)])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_int8_is_exact(n, k, m, dtype, bias, isa):
    g = _gen(4)
    weight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    weight[0, :] = -128  # the extremes: sums of pairs of -128 * -128 must not saturate
    scale = torch.rand(n, generator=g) * 0.01
    x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m).reshape(m, 1)).to(dtype)  # rows far apart
    x[0, :] = -x[0].abs()  # a row whose absmax is negative: q = -128 there
    if m > 2:
        x[1] = 0  # an all-zero row
    b = torch.randn(n, generator=g) if bias else None
    w = QL.prepare_int8(weight, scale)
    assert w.cpu is not None
    assert bool(w.cpu.amx_rows) == (isa == "avx512" and QC.quant_kernel_info()["amx_int8"])  # the tile layout
    out = QL.int8_linear(x, w, b)
    ref = QL.int8_linear_ref(x, weight, scale, b)
    assert out.dtype == dtype and torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_int8_silu_mul_on_amx_tiles_rounds_as_the_unfused_ops(dtype, bias, monkeypatch):
    kernel = QC.build_quant_linear("avx512")
    if kernel is None or not QC.quant_kernel_info(kernel)["amx_int8"]:
        pytest.skip("no AMX build here")
    monkeypatch.setattr(QC, "quant_kernel", lambda: kernel)
    g = _gen(14)
    i, k = 96, 200  # three panels of gate, three of up
    weight = torch.randint(-128, 128, (2 * i, k), generator=g, dtype=torch.int8)
    scale = torch.rand(2 * i, generator=g) * 0.01
    b = torch.randn(2 * i, generator=g) if bias else None
    w = QL.prepare_int8(weight, scale)
    for m in (1, 5, 33):
        x = (torch.randn(m, k, generator=g) * 4).to(dtype)
        gate, up = QL.int8_linear_ref(x, weight, scale, b).split(i, dim=-1)  # each in x.dtype, as the model rounds
        want = torch.nn.functional.silu(gate) * up
        got = QL.int8_linear_silu_mul(x, w, b, i)
        assert got.shape == (m, i) and got.dtype == dtype
        if dtype == torch.bfloat16:  # silu's exp may differ from torch's in the last float32 bit, rarely seen in bf16
            assert (got == want).float().mean() > 0.98
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert QL.int8_linear_silu_mul(x, w, b, i - 32) is None  # not this matrix's halves
    assert QL.int8_linear_silu_mul(x.half(), w, b, i) is None


def test_int8_amx_tiles_compiled_and_switched_off(monkeypatch):
    kernel = QC.build_quant_linear("avx512")
    if kernel is None or not QC.quant_kernel_info(kernel)["amx_int8"]:
        pytest.skip("no AMX build here")
    monkeypatch.setattr(QC, "quant_kernel", lambda: kernel)
    g = _gen(13)
    weight = torch.randint(-128, 128, (100, 200), generator=g, dtype=torch.int8)
    scale = torch.rand(100, generator=g) * 0.01
    b = torch.randn(100, generator=g)
    w = QL.prepare_int8(weight, scale, keep_canonical=False)
    assert w.cpu.amx_rows == 1 and w.onednn is None and w.onednn_rows is None and w.weight is None  # held once
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: QL.int8_linear(t, w, b), fullgraph=True, dynamic=False)
    for m in (1, 17, 33):
        x = torch.randn(m, 200, generator=g).bfloat16()
        assert torch.equal(compiled(x), QL.int8_linear_ref(x, weight, scale, b)), m
    monkeypatch.setenv(QC.AMX_ROWS_ENV, "0")  # off: the pair layout (and oneDNN from its row count)
    assert QL.prepare_int8(weight, scale).cpu.amx_rows == 0


def test_int8_leading_dims_and_float16(isa):
    weight = torch.randint(-128, 128, (48, 64), generator=_gen(5), dtype=torch.int8)
    scale = torch.rand(48, 1, generator=_gen(6))
    x = torch.randn(2, 5, 64, generator=_gen(7)).half()
    out = QL.int8_linear(x, QL.prepare_int8(weight, scale), None)
    assert out.shape == (2, 5, 48) and torch.equal(out, QL.int8_linear_ref(x, weight, scale.reshape(-1), None))


# ----------------------------------------------------------------------------------------------------- FP8


def _fp8(n: int, k: int, kind: str, seed: int = 8):
    g = _gen(seed)
    weight = (torch.randn(n, k, generator=g) * 64).to(torch.float8_e4m3fn)
    weight[0, :16] = torch.tensor([0.0, -0.0, 2**-9, -(2**-9), 2**-7, 448, -448, 0.001] * 2)  # subnormals, ends
    if kind == "tensor":
        return weight, torch.rand((), generator=g) * 0.1, None
    if kind == "channel":
        return weight, torch.rand(n, generator=g) * 0.1, None
    block = (128, 128) if kind == "block128" else (32, 64)
    return weight, torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 0.1, block


@pytest.mark.parametrize(
    "kind,n,k", [("tensor", 40, 100), ("channel", 72, 37), ("block128", 256, 384), ("block32x64", 100, 200)]
)
@pytest.mark.parametrize("act,act_group", [("token", 0), ("static", 0), ("group", 4)])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_matches_reference(kind, n, k, act, act_group, m, dtype, isa):
    weight, scale, block = _fp8(n, k, kind)
    k_used = k - k % act_group if act_group else k
    weight = weight[:, :k_used].contiguous()
    input_scale = torch.tensor(0.02) if act == "static" else None
    w = QL.prepare_fp8(weight, scale, block, act, act_group, input_scale)
    assert w.cpu is not None
    ref_w = QL.FP8Weights(weight, scale.float(), block, act, act_group, input_scale)
    g = _gen(9)
    x = torch.randn(m, k_used, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if m % 2 else None
    out = QL.fp8_linear(x, w, b)
    ref = QL.fp8_linear_ref(x, ref_w, b)
    xq = QL.quantize_fp8_ref(x, act, act_group, input_scale)
    _check(out, ref, _bound(xq, QL.dequantize_fp8_ref(weight, scale.float(), block), b))


@pytest.mark.parametrize("act,act_group", [("token", 0), ("static", 0), ("group", 8)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_activation_rounding_is_exact(act, act_group, dtype, isa):
    # W = I: the output is x as the kernel rounded it through e4m3, which must be quantize_fp8_ref's x exactly (ties
    # to even in the normal and subnormal ranges, the clamp at 448, signs and zeros)
    k = 40
    ties = [1.0625, 1.1875, -1.0625, 2**-10, 3 * 2**-10, -(3 * 2**-10), 2**-6 - 2**-11, 500.0, -500.0, 0.0]
    x = torch.cat([torch.tensor(ties), torch.randn(3 * k - len(ties), generator=_gen(11)) * 3]).reshape(3, k)
    x[2] *= 1e-4  # a row whose dynamic scale is tiny
    x = x.to(dtype)
    eye = torch.eye(k).to(torch.float8_e4m3fn)
    input_scale = torch.tensor(1.0) if act == "static" else None
    w = QL.prepare_fp8(eye, torch.tensor(1.0), None, act, act_group, input_scale)
    expected = QL.quantize_fp8_ref(x, act, act_group, input_scale).to(dtype)
    assert torch.equal(QL.fp8_linear(x, w, None), expected)


@pytest.mark.parametrize("act", ["token", "static"])
def test_fp8_amx_tiles_match_the_reference(act, monkeypatch):
    kernel = QC.build_quant_linear("avx512")
    if kernel is None or not QC.quant_kernel_info(kernel)["amx"]:
        pytest.skip("no AMX build here")
    monkeypatch.setattr(QC, "quant_kernel", lambda: kernel)
    monkeypatch.setenv(QC.AMX_ROWS_ENV, "3")
    input_scale = torch.tensor(0.02) if act == "static" else None
    for kind, n, k, m in (
        ("tensor", 40, 100, 3),
        ("channel", 72, 37, 16),
        ("channel", 600, 448, 33),
        ("tensor", 64, 1000, 40),
    ):
        weight, scale, block = _fp8(n, k, kind, seed=n)
        w = QL.prepare_fp8(weight, scale, block, act, 0, input_scale)
        ref_w = QL.FP8Weights(weight, scale.float(), block, act, 0, input_scale)
        x = torch.randn(m, k, generator=_gen(m)).bfloat16()
        b = torch.randn(n, generator=_gen(n))
        assert w.cpu.amx_rows == 1 and _on_tiles(w, x)  # FP8: every row count
        xq = QL.quantize_fp8_ref(x, act, 0, input_scale)
        _check(
            QL.fp8_linear(x, w, b),
            QL.fp8_linear_ref(x, ref_w, b),
            _bound(xq, QL.dequantize_fp8_ref(weight, scale.float(), block), b),
        )
    # W = I on the tiles: x exactly as the reference rounds it through e4m3 (the sums hold one product each)
    k = 40
    x = (torch.randn(5, k, generator=_gen(12)) * 3).bfloat16()
    x[0, :4] = torch.tensor([1.0625, 500.0, -500.0, 0.0])
    eye = QL.prepare_fp8(
        torch.eye(k).to(torch.float8_e4m3fn),
        torch.tensor(1.0),
        None,
        act,
        0,
        None if input_scale is None else torch.tensor(1.0),
    )
    assert _on_tiles(eye, x)
    expected = QL.quantize_fp8_ref(x, act, 0, None if input_scale is None else torch.tensor(1.0)).bfloat16()
    assert torch.equal(QL.fp8_linear(x, eye, None), expected)
    # block scales along K and per-group activations stay on the register kernel
    weight, scale, block = _fp8(100, 200, "block32x64")
    assert QL.prepare_fp8(weight, scale, block, act, 0, input_scale).cpu.amx_rows == 0
    weight, scale, _ = _fp8(72, 64, "channel")
    assert QL.prepare_fp8(weight, scale, None, "group", 32).cpu.amx_rows == 0


def test_fp8_large_scales_keep_the_reference(isa):
    weight, _, _ = _fp8(32, 64, "tensor")
    w = QL.prepare_fp8(weight, torch.tensor(300.0), None, "token")  # s * 2^120 would overflow float32
    assert w.cpu is None
    x = torch.randn(2, 64, generator=_gen(10))
    torch.testing.assert_close(QL.fp8_linear(x, w, None), QL.fp8_linear_ref(x, w, None))


def test_strided_and_empty_inputs(isa):
    # rows further apart than K (a column slice), and no rows at all
    q, scales, zeros, gs, _ = _wna16(40, 64, 32, 4, False)
    wna16 = QL.prepare_wna16(q, scales, zeros, gs, 4)
    weight = torch.randint(-128, 128, (40, 64), generator=_gen(13), dtype=torch.int8)
    int8 = QL.prepare_int8(weight, torch.rand(40))
    wide = torch.randn(5, 100, generator=_gen(14))
    x = wide[:, 10:74]  # [5, 64], rows 100 apart
    _check(
        QL.wna16_linear(x, wna16, None),
        QL.wna16_linear_ref(x, q, scales, zeros, gs, None, None),
        _bound(x, QL.dequantize_wna16_ref(q, scales, zeros, gs), None),
    )
    assert torch.equal(QL.int8_linear(x, int8, None), QL.int8_linear_ref(x, weight, int8.scale, None))
    assert QL.wna16_linear(x[:0], wna16, None).shape == (0, 40) and QL.int8_linear(x[:0], int8, None).shape == (0, 40)


def test_kernel_reports_its_build(isa):
    info = QC.quant_kernel_info()
    assert info["width"] == 256 and isinstance(info["vnni"], bool) and isinstance(info["amx"], bool)
    if isa == "avx2":
        assert not info["vnni"] and not info["amx"]


def test_ops_trace_into_a_full_graph(isa):
    # torch.compile(fullgraph=True) (the runner's -O1) sees the opaque op and its fake; eager calls skip the op
    g = _gen(12)
    q, scales, zeros, gs, g_idx = _wna16(64, 128, 32, 4, True)
    wna16 = QL.prepare_wna16(q, scales, zeros, gs, 4, g_idx)
    int8 = QL.prepare_int8(torch.randint(-128, 128, (64, 128), generator=g, dtype=torch.int8), torch.rand(64))
    fp8 = QL.prepare_fp8(torch.randn(64, 128, generator=g).to(torch.float8_e4m3fn), torch.rand(64), None, "group", 32)

    def forward(x, b):
        return QL.wna16_linear(x, wna16, b) + QL.int8_linear(x, int8, None) + QL.fp8_linear(x, fp8, b)

    x, b = torch.randn(3, 128, generator=g).bfloat16(), torch.randn(64, generator=g)
    assert torch.equal(torch.compile(forward, fullgraph=True, backend="aot_eager")(x, b), forward(x, b))
