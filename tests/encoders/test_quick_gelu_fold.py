"""Quick-GELU folded into the MLP's weights (`VisionMLP.fold_quick_gelu`): fc1 scaled by 1.702, fc2 by its inverse,
silu inside fc1's matmul (oneDNN's swish post-op where the matrix is prepacked, bf16 on AMX) gives the unfolded
MLP's output; the dual-tower embedders fold at load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from vlserve.encoders.vision_layers import VisionMLP, fold_quick_gelu_mlps
from vlserve.kernels.onednn_linear import onednn_linear, onednn_prepacks, prepack_onednn
from vlserve.kernels.packed_linear import pack_linears_for_cpu
from vlserve.kernels.quick_gelu_cpu import quick_gelu_ref


def _mlp(act: str, seed: int = 0) -> VisionMLP:
    torch.manual_seed(seed)
    mlp = VisionMLP(SimpleNamespace(width=64, mlp_hidden=256, hidden_act=act))
    for p in mlp.parameters():
        p.data.normal_(0, 0.3)
    return mlp


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_folded_mlp_equals_the_unfolded_one_in_float32(rows):
    mlp = _mlp("quick_gelu")
    x = torch.randn(rows, 64)
    with torch.no_grad():
        ref = mlp.fc2(quick_gelu_ref(mlp.fc1(x)))
        assert mlp.fold_quick_gelu()
        assert not mlp.fold_quick_gelu()  # never twice
        torch.testing.assert_close(mlp(x), ref, atol=2e-5, rtol=2e-5)


def test_other_activations_do_not_fold():
    mlp = _mlp("gelu_pytorch_tanh")
    before = [p.clone() for p in mlp.parameters()]
    assert fold_quick_gelu_mlps(torch.nn.Sequential(mlp)) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, mlp.parameters()))


def test_a_packed_mlp_refuses_to_fold():
    mlp = _mlp("quick_gelu")
    mlp.fc1.weight = None
    with pytest.raises(ValueError, match="before packing"):
        mlp.fold_quick_gelu()


@pytest.mark.skipif(not onednn_prepacks(torch.bfloat16), reason="bf16 matrices are prepacked for oneDNN on AMX only")
def test_swish_post_op_is_silu_of_the_matmul():
    torch.manual_seed(1)
    x, w, b = torch.randn(300, 64, dtype=torch.bfloat16), torch.randn(96, 64) * 0.2, torch.randn(96) * 0.5
    w = w.to(torch.bfloat16)
    plain = onednn_linear(x, prepack_onednn(w), b.to(torch.bfloat16), 96)
    fused = onednn_linear(x, prepack_onednn(w), b.to(torch.bfloat16), 96, post_op="swish")
    # fused: silu of each float32 sum, rounded once; plain: the sum rounded to bf16, then silu
    torch.testing.assert_close(fused.float(), F.silu(plain.float()), atol=3e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="post_op"):
        onednn_linear(x, prepack_onednn(w), None, 96, post_op="gelu")


@pytest.mark.skipif(not onednn_prepacks(torch.bfloat16), reason="bf16 matrices are prepacked for oneDNN on AMX only")
def test_folded_bf16_mlp_on_prepacked_matrices_is_close_to_float32():
    mlp = _mlp("quick_gelu")
    x = torch.randn(300, 64)
    with torch.no_grad():
        ref = mlp(x)  # float32, unfolded
        mlp = mlp.to(torch.bfloat16)
        unfolded = mlp(x.to(torch.bfloat16)).float()
        mlp.fold_quick_gelu()
        pack_linears_for_cpu(mlp, many_rows=[mlp])
        assert mlp.fc1.weight is None and mlp.fc1.onednn_weight is not None  # held prepacked: the fused path
        folded = mlp(x.to(torch.bfloat16)).float()
    err_folded, err_unfolded = (folded - ref).norm() / ref.norm(), (unfolded - ref).norm() / ref.norm()
    assert err_folded < 1e-2
    assert err_folded < 2 * err_unfolded
