"""Encoders on the packed CPU linear kernel: the patch convolutions and the Whisper stem as GEMMs on packed weights
match torch's convolutions, a whole tower packed matches itself unpacked, and modules built elsewhere (timm) keep
the matrix they read directly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vlserve.encoders import Qwen2VisionTower
from vlserve.encoders.vision_layers import VisionTowerConfig
from vlserve.kernels.cpu_linear import cpu_linear_isa
from vlserve.kernels.packed_linear import (
    PackableConv1d,
    PackableLinear,
    PatchConv2d,
    PatchConv3d,
    pack_linears_for_cpu,
    packable,
)

# bf16: each output is rounded once, against torch's convolution, which rounds its own way
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _packed_kernel_at_every_row_count(monkeypatch):
    """These tests check the packed kernel itself: no row count is handed to torch's matmul (on AMX machines bf16
    layers otherwise do so from 8 rows on; tests/kernels/test_onednn_rows.py checks that split)."""
    monkeypatch.setenv("VLSERVE_CPU_ONEDNN_ROWS", "0")


def _needs_kernel(dtype: torch.dtype) -> None:
    if cpu_linear_isa(dtype) is None:
        pytest.skip("no packed CPU linear kernel on this machine")


def _randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return module


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias,size", [(True, 28), (False, 30)])  # 30: a ragged edge the conv drops too
def test_patch_conv2d_packed_matches_torch_conv(dtype, bias, size):
    _needs_kernel(dtype)
    conv = _randomize(PatchConv2d(3, 40, 14, bias=bias)).to(dtype)  # E = 40: a ragged last panel
    ref = nn.Conv2d(3, 40, 14, stride=14, bias=bias).to(dtype)
    ref.load_state_dict(conv.state_dict())
    pixels = torch.randn(2, 3, size, size).to(dtype)
    expected = ref(pixels).flatten(2).transpose(1, 2)  # [N, np, E]
    assert conv.pack_for_cpu() and conv.weight is None
    torch.testing.assert_close(conv(pixels), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_patch_conv3d_packed_matches_the_flattened_conv(dtype):
    _needs_kernel(dtype)
    conv = _randomize(PatchConv3d(3, 64, (2, 14, 14))).to(dtype)
    rows = torch.randn(37, 3 * 2 * 14 * 14).to(dtype)
    expected = F.conv3d(rows.view(37, 3, 2, 14, 14), conv.weight).view(37, 64)
    assert conv.pack_for_cpu()
    torch.testing.assert_close(conv(rows), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("frames", [9, 10])
def test_conv1d_stem_packed_matches_torch_conv(dtype, stride, frames):
    _needs_kernel(dtype)
    conv = _randomize(PackableConv1d(16, 48, kernel_size=3, stride=stride, padding=1)).to(dtype)
    mel = torch.randn(2, 16, frames).to(dtype)
    expected = conv(mel)  # unpacked: torch's conv1d
    assert conv.pack_for_cpu() and conv.weight is None
    got = conv(mel)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_whole_tower_packed_matches_itself_unpacked(dtype):
    _needs_kernel(dtype)
    cfg = VisionTowerConfig(depth=2, width=64, num_heads=2, mlp_hidden=128, hidden_act="quick_gelu", out_dim=96)
    tower = _randomize(Qwen2VisionTower(cfg)).to(dtype).eval()
    grids = [(1, 4, 6), (2, 2, 4)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 14 * 14).to(dtype)
    with torch.inference_mode():
        expected = tower(pixels, grids)
        linears = sum(isinstance(m, PackableLinear) for m in tower.modules())
        assert pack_linears_for_cpu(tower) == linears + 1  # and the patch embedding
        assert all(m.weight is None for m in tower.modules() if isinstance(m, PackableLinear))
        got = tower(pixels, grids)
    torch.testing.assert_close(got, expected, **TOL[dtype])


class _ReadsWeight(nn.Module):
    """Like timm's EVA attention: one linear called, another read by `.weight`."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.qkv = nn.Linear(32, 96, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.linear(x, self.qkv.weight)[..., :32])


def test_packable_modules_from_elsewhere_keep_the_matrix_they_read():
    _needs_kernel(torch.float32)
    module = _randomize(_ReadsWeight())
    x = torch.randn(5, 32)
    expected = module(x)
    packable(module)
    assert isinstance(module.proj, PackableLinear) and isinstance(module.qkv, PackableLinear)
    assert pack_linears_for_cpu(module) == 2
    assert module.qkv.weight is not None and module.proj.packed_weight is not None
    torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-5)
