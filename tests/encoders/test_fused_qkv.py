"""The dual towers' fused q/k/v projection (`VitAttention(fused_qkv=True)`): HF's three q/k/v weights load into the
thirds of one `qkv_proj`, the fused tower computes what the three-linear tower computes, and each third is reported
loaded (by its checkpoint name) on its own."""

from __future__ import annotations

import pytest
import torch

from vlserve.encoders.clip_vision import ClipVisionTower, VitAttention, VitConfig
from vlserve.encoders.pooled_vision import ClipPooledVisionTower

CFG = VitConfig(
    depth=2,
    width=32,
    num_heads=4,
    mlp_hidden=64,
    hidden_act="quick_gelu",
    image_size=28,
    patch_size=14,
    layer_norm_eps=1e-5,
)


def _hf_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under HF's names (the three-linear tower's own names)."""
    torch.manual_seed(seed)
    return {f"vision_model.{n}": torch.randn_like(p) * 0.2 for n, p in ClipVisionTower(CFG).named_parameters()}


def test_fused_tower_loads_hf_names_and_matches_the_three_linear_tower():
    weights = _hf_weights()
    plain, fused = ClipVisionTower(CFG), ClipPooledVisionTower(CFG)
    assert plain.load_weights(weights.items()) == plain.expected_weight_names()
    assert fused.load_weights(weights.items()) == fused.expected_weight_names()
    attn = fused.encoder.layers[1].self_attn
    assert attn.fused_qkv and not hasattr(attn, "q_proj")
    torch.testing.assert_close(
        attn.qkv_proj.weight[32:64], weights["vision_model.encoder.layers.1.self_attn.k_proj.weight"]
    )
    pixels = torch.randn(3, 3, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(fused(pixels, [1, 2]), plain(pixels, [1, 2]), atol=1e-5, rtol=1e-5)


def test_project_qkv_gives_three_rows_by_width_tensors():
    for fused in (False, True):
        q, k, v = VitAttention(CFG, fused_qkv=fused).project_qkv(torch.randn(5, 32))
        assert q.shape == k.shape == v.shape == (5, 32)


def test_a_missing_third_is_reported_missing():
    weights = _hf_weights()
    del weights["vision_model.encoder.layers.0.self_attn.v_proj.bias"]
    tower = ClipPooledVisionTower(CFG)
    missing = tower.expected_weight_names() - tower.load_weights(weights.items())
    assert missing == {"encoder.layers.0.self_attn.v_proj.bias"}


def test_a_third_of_the_wrong_shape_is_refused():
    weights = _hf_weights()
    weights["vision_model.encoder.layers.0.self_attn.q_proj.weight"] = torch.zeros(32, 31)
    with pytest.raises(ValueError, match="q_proj.weight.*expected \\(32, 32\\)"):
        ClipPooledVisionTower(CFG).load_weights(weights.items())
