"""Where torch's matmul beats the packed kernel from some row count on (bf16 on AMX CPUs): layers keep both
matrices (bf16 on AMX: the second one prepacked for oneDNN) and split by rows, towers stay unpacked (held prepacked). $VLSERVE_CPU_ONEDNN_ROWS forces the split on any CPU here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vlserve.kernels import cpu_linear as cl
from vlserve.kernels.onednn_linear import onednn_linear, onednn_prepacks, prepack_onednn
from vlserve.models.layers import GatedMLP
from vlserve.models.parallel_layers import ColumnParallelLinear, pack_linears_for_cpu

pytestmark = pytest.mark.skipif(cl.cpu_linear_kernel() is None, reason="no AVX2 + FMA or AVX-512 here")
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.fixture
def kernel_rows(monkeypatch):
    """The row counts of every packed-kernel call from now on."""
    rows = []
    kernel = cl.cpu_linear_kernel()
    monkeypatch.setattr(cl, "cpu_linear_kernel", lambda: lambda *args: rows.append(args[7]) or kernel(*args))
    return rows


def test_policy(monkeypatch):
    monkeypatch.delenv(cl.ONEDNN_ROWS_ENV, raising=False)
    assert cl.onednn_min_rows(torch.float32) is None  # float32: the packed kernel wins at every size measured
    bf16_rows = cl.ONEDNN_BF16_ROWS_OVER_TILES if cl.tile_rows() else 4  # (our own AMX tiles win below 128)
    assert cl.onednn_min_rows(torch.bfloat16) == (bf16_rows if cl._has_amx() else None)
    assert cl.onednn_min_rows(torch.int8) == (16 if cl._has_amx() else None)
    monkeypatch.setenv(cl.ONEDNN_ROWS_ENV, "0")
    assert cl.onednn_min_rows(torch.bfloat16) is None
    monkeypatch.setenv(cl.ONEDNN_ROWS_ENV, "5")
    assert cl.onednn_min_rows(torch.float32) == 5
    monkeypatch.setenv(cl.ONEDNN_ROWS_ENV, "many")
    with pytest.raises(ValueError, match=cl.ONEDNN_ROWS_ENV):
        cl.onednn_min_rows(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_splits_by_rows(monkeypatch, kernel_rows, dtype):
    monkeypatch.setenv(cl.ONEDNN_ROWS_ENV, "8")
    g = torch.Generator().manual_seed(0)
    layer = ColumnParallelLinear(64, 96, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 64, generator=g) / 8)
        layer.bias.copy_(torch.randn(96, generator=g))
    layer = layer.to(dtype)
    ref_w, ref_b = layer.weight.detach().clone(), layer.bias.detach().clone()
    assert layer.pack_for_cpu() and layer.onednn_rows == 8
    assert layer.packed_weight is not None  # both held: bf16 on AMX as oneDNN's prepacked matrix, else as is
    prepacked = dtype is torch.bfloat16 and onednn_prepacks(dtype)
    assert (layer.onednn_weight is not None) == prepacked and (layer.weight is None) == prepacked
    for rows, through_kernel in ((1, True), (7, True), (8, False), (3 * 7, False)):
        kernel_rows.clear()
        x = torch.randn(rows, 64, generator=g).to(dtype)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), F.linear(x, ref_w, ref_b), **TOL[dtype])
        assert kernel_rows == ([rows] if through_kernel else []), rows
    x3 = torch.randn(2, 5, 64, generator=g).to(dtype)  # rows count across leading dims: 10 >= 8
    kernel_rows.clear()
    with torch.inference_mode():
        torch.testing.assert_close(layer(x3), F.linear(x3, ref_w, ref_b), **TOL[dtype])
    assert kernel_rows == []


def test_without_the_split_the_weight_is_held_once(monkeypatch):
    monkeypatch.setenv(cl.ONEDNN_ROWS_ENV, "0")
    layer = ColumnParallelLinear(64, 96, bias=False).to(torch.bfloat16)
    assert layer.pack_for_cpu() and layer.onednn_rows is None and layer.weight is None


def test_gated_mlp_fuses_only_below_the_split(monkeypatch, kernel_rows):
    monkeypatch.setenv(cl.ONEDNN_ROWS_ENV, "8")
    torch.manual_seed(0)
    mlp = GatedMLP(64, 64).eval()
    x_small, x_big = torch.randn(3, 64), torch.randn(12, 64)
    with torch.inference_mode():
        expected = [mlp(x_small), mlp(x_big)]  # unpacked: torch only
        pack_linears_for_cpu(mlp)
        kernel_rows.clear()
        torch.testing.assert_close(mlp(x_small), expected[0], **TOL[torch.float32])
        assert kernel_rows == [3, 3]  # gate_up with silu fused, then down
        kernel_rows.clear()
        torch.testing.assert_close(mlp(x_big), expected[1], **TOL[torch.float32])
        assert kernel_rows == []


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.tower = nn.Sequential(ColumnParallelLinear(32, 64), ColumnParallelLinear(64, 32))
        self.decoder = ColumnParallelLinear(32, 32)


@pytest.mark.parametrize("split", ["0", "8"])
def test_towers_stay_unpacked_where_torch_wins(monkeypatch, split):
    monkeypatch.setenv(cl.ONEDNN_ROWS_ENV, split)
    model = _Model()
    packed = pack_linears_for_cpu(model, many_rows=[model.tower])
    tower = list(model.tower)
    if split == "0":  # the kernel wins everywhere: everything packed, each matrix held once
        assert packed == 3 and all(m.packed_weight is not None and m.weight is None for m in [*tower, model.decoder])
    else:
        assert packed == 1 and all(m.packed_weight is None and m.weight is not None for m in tower)
        assert model.decoder.packed_weight is not None and model.decoder.weight is not None


@pytest.mark.parametrize("intel", [True, False])
def test_float32_towers_go_to_torch_by_default_on_intel(monkeypatch, intel):
    monkeypatch.delenv(cl.ONEDNN_ROWS_ENV, raising=False)
    monkeypatch.setattr(cl, "intel_cpu", lambda: intel)
    model = _Model()
    if intel:  # float32: MKL's sgemm serves a tower's many rows, the decoder stays on the kernel alone
        assert pack_linears_for_cpu(model, many_rows=[model.tower]) == 1
        assert all(m.packed_weight is None and m.weight is not None for m in model.tower)
    else:  # elsewhere the packed kernel beat MKL at a tower's rows: every matrix packed, held once
        assert pack_linears_for_cpu(model, many_rows=[model.tower]) == 3
        assert all(m.packed_weight is not None and m.weight is None for m in model.tower)
    assert model.decoder.packed_weight is not None and model.decoder.weight is None


@pytest.mark.skipif(not onednn_prepacks(torch.bfloat16), reason="bf16 prepacking for oneDNN needs AMX")
def test_bf16_towers_are_held_prepacked_and_match_f_linear():
    torch.manual_seed(0)
    model = _Model().to(torch.bfloat16)
    plain = [m.weight.detach().clone() for m in model.tower]
    x = torch.randn(300, 32).to(torch.bfloat16)
    with torch.inference_mode():
        want = F.linear(F.linear(x, plain[0], model.tower[0].bias), plain[1], model.tower[1].bias)
        pack_linears_for_cpu(model, many_rows=[model.tower])
        assert all(m.weight is None and m.packed_weight is None and m.onednn_weight is not None for m in model.tower)
        assert torch.equal(model.tower(x), want)  # the same sums as torch's own bf16 linear


@pytest.mark.skipif(not onednn_prepacks(torch.bfloat16), reason="bf16 prepacking for oneDNN needs AMX")
@pytest.mark.parametrize("n, k, shape", [(96, 64, (5,)), (1152, 896, (33,)), (4864, 896, (2, 40)), (72, 40, (513,))])
def test_onednn_linear_equals_f_linear(n, k, shape):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(n, k, generator=g) / 8).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    x = torch.randn(*shape, k, generator=g).to(torch.bfloat16)
    packed = prepack_onednn(w)
    for bias in (b, None):
        want = F.linear(x, w, bias)
        assert torch.equal(onednn_linear(x, packed, bias, n), want)
        torch._dynamo.reset()
        compiled = torch.compile(lambda t, bias=bias: onednn_linear(t, packed, bias, n), fullgraph=True, dynamic=False)
        assert torch.equal(compiled(x), want)


def test_w8a8_splits_by_rows(monkeypatch):
    from vlserve.kernels import quant_linear as QL

    if QL.QC.quant_kernel() is None:
        pytest.skip("no quantized CPU kernel here")
    monkeypatch.setenv(cl.ONEDNN_ROWS_ENV, "16")
    monkeypatch.setenv(QL.QC.AMX_ROWS_ENV, "0")  # (where W8A8 runs on our AMX tiles, at every row count)
    g = torch.Generator().manual_seed(1)
    weight = torch.randint(-128, 128, (96, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(96, generator=g) / 50
    bias = torch.randn(96, generator=g)
    w = QL.prepare_int8(weight, scale, keep_canonical=False)
    assert w.onednn_rows == 16 and w.cpu is not None  # both held: the plain matrix, or oneDNN's prepacked one
    assert (w.weight is None) == (w.onednn is not None) == cl._has_amx()
    calls = []
    monkeypatch.setattr(
        QL.QC, "quant_matmul", lambda *a: calls.append(a[0].shape[0]) or QL.int8_linear_ref(a[0], weight, w.scale, a[2])
    )
    for rows, through_kernel in ((4, True), (15, True), (16, False), (40, False)):
        calls.clear()
        x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        got = QL.int8_linear(x, w, bias)
        assert calls == ([rows] if through_kernel else []), rows
        # torch's int8 matmul: the reference's quantization, exact int32 sums, the same epilogue: equal bits
        assert torch.equal(got, QL.int8_linear_ref(x, weight, w.scale, bias))
    monkeypatch.setenv(cl.ONEDNN_ROWS_ENV, "0")
    assert QL.prepare_int8(weight, scale, keep_canonical=False).weight is None  # held once without the split


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_w8a8_onednn_ends_in_cpp_equal_the_reference(dtype, with_bias):
    from vlserve.kernels import quant_linear as QL

    if QL.QC.quant_kernel() is None:
        pytest.skip("no quantized CPU kernel here")
    g = torch.Generator().manual_seed(2)
    for n, k, shape in ((70, 37, (3, 9)), (96, 64, (40,)), (33, 200, (2, 17))):  # K off the 16-wide loop, N off 32
        weight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, generator=g) / 50
        bias = torch.randn(n, generator=g) if with_bias else None
        x = (torch.randn(*shape, k, generator=g) * 3).to(dtype)
        x[..., 0, :5] = 0.0  # zeros and a row's exact ties survive the C++ rounding as torch rounds them
        want = QL.int8_linear_ref(x, weight, scale, bias)
        x.view(-1, k)[1, :3] = torch.tensor([127.5, -128.0, 64.0]).to(dtype) * x.view(-1, k)[1].abs().amax() / 128
        want = QL.int8_linear_ref(x, weight, scale, bias)
        prepacked = QL.QC.prepack_int8_onednn(weight)  # None without AMX
        for w in (weight, prepacked) if prepacked is not None else (weight,):
            got = QL.QC.int8_matmul_onednn(x, w, scale, bias)
            assert got.shape == want.shape and got.dtype == dtype
            assert torch.equal(got, want), (n, k, shape, type(w))
            torch._dynamo.reset()  # one graph per case (every case would count against one recompile limit)
            layer = _Int8Layer(w, scale, bias)
            assert torch.equal(torch.compile(layer, fullgraph=True, dynamic=False)(x), want)


class _Int8Layer(torch.nn.Module):
    """The matrix as a layer holds it (an attribute, as the model's schemes do), for torch.compile."""

    def __init__(self, w, scale, bias):
        super().__init__()
        self.w, self.scale, self.bias = w, scale, bias

    def forward(self, x):
        from vlserve.kernels import quant_linear as QL

        return QL.QC.int8_matmul_onednn(x, self.w, self.scale, self.bias)


def test_row_counts_are_padded_to_few_sizes_and_rows_keep_their_results():
    # oneDNN builds a primitive per shape: row counts past 16 run padded to one of 16 sizes an octave, and each
    # output row is the one the unpadded product gives (a row reads only its own input row)
    from vlserve.kernels.onednn_linear import padded_rows

    assert [padded_rows(m) for m in (1, 16, 17, 31, 32, 33, 101, 1000, 1453, 2045)] == [
        1, 16, 17, 31, 32, 34, 104, 1024, 1472, 2048,
    ]  # fmt: skip
    assert len({padded_rows(m) for m in range(1025, 2049)}) == 16
    assert all(m <= padded_rows(m) <= m * 17 / 16 for m in range(1, 5000))
    if not onednn_prepacks(torch.bfloat16):
        pytest.skip("no oneDNN prepacking here (bf16 on AMX)")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=g) / 8).bfloat16()
    x = torch.randn(1453, 64, generator=g).bfloat16()
    packed = prepack_onednn(w)
    with torch.no_grad():
        full = onednn_linear(x, packed, None, 96)
        part = onednn_linear(x[:101], packed, None, 96)  # another padded size (104)
        exact = onednn_linear(x[:16], packed, None, 96)  # unpadded
    assert full.shape == (1453, 96) and full.is_contiguous()
    assert torch.equal(full[:101], part) and torch.equal(full[:16], exact)
    torch.testing.assert_close(full.float(), F.linear(x.float(), w.float()), **TOL[torch.bfloat16])


def test_rows_with_room_are_read_in_place_whatever_follows_them(monkeypatch):
    # a tensor from `empty_rows` (and any contiguous view with storage behind it) runs padded without a copy; the
    # rows past it hold anything, NaN here, and no output row sees them
    from vlserve.kernels.onednn_linear import empty_rows, padded_rows

    if not onednn_prepacks(torch.bfloat16):
        pytest.skip("no oneDNN prepacking here (bf16 on AMX)")
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(96, 64, generator=g) / 8).bfloat16()
    packed = prepack_onednn(w)
    x = empty_rows(101, 64, dtype=torch.bfloat16)
    assert padded_rows(101) == 104 and x.untyped_storage().nbytes() == 104 * 64 * 2
    x.as_strided((104, 64), (64, 1))[101:] = float("nan")
    x.copy_(torch.randn(101, 64, generator=g))
    with torch.no_grad():
        copied = onednn_linear(x.clone(), packed, None, 96)  # no room: padded through a copy
        monkeypatch.setattr(torch.Tensor, "new_empty", lambda *a, **k: pytest.fail("copied rows with room"))
        in_place = onednn_linear(x, packed, None, 96)
    assert not in_place.isnan().any() and torch.equal(in_place, copied)
    torch.testing.assert_close(in_place.float(), F.linear(x.float(), w.float()), **TOL[torch.bfloat16])
