"""Quantized linear layers' matmuls: `y = x W^T + b` with W held quantized (the kernels under
`models.quantization`'s schemes).

Three families, each as a `prepare_*` (run once, after loading: canonical tensors -> the layout the kernel of this
device reads) and a `*_linear` that multiplies; each has a `*_ref` twin in plain torch that states the math:
- W8A8 INT8 (`prepare_int8` / `int8_linear`): int8 weights with a float scale per output channel; the activations
  are quantized to int8 per token at run time (symmetric, scale = absmax / 127), the products summed in int32.
- WNA16 (`prepare_wna16` / `wna16_linear`): 4- or 8-bit integer weights in groups along the input dim, each group
  with a float scale and an integer zero point (`w = (q - z) * s`); activations stay float. GPTQ's act order (a
  `g_idx` that maps each input column to its group) becomes a permutation of the input columns, applied to x.
- FP8 (`prepare_fp8` / `fp8_linear`): float8_e4m3fn weights with a scale per tensor, per output channel or per
  block; activations quantized to fp8 per token (or per group of columns) at run time, or with a static scale.

Canonical inputs (what the checkpoint formats are unpacked to): `q` uint8 [N, K] holding unsigned values in
[0, 2^bits), `scales` float [N, G] and `zeros` int [N, G] with G = K / group_size groups along the input dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # largest finite float8_e4m3fn


# ----------------------------------------------------------------------------------------------------- W8A8 INT8

@dataclass
class Int8Weights:
    """A W8A8 matrix: `weight` int8 [N, K], `scale` float32 [N] (one per output channel)."""

    weight: torch.Tensor
    scale: torch.Tensor


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (int8 [M, K], float32 scale [M, 1]): symmetric per-row quantization, scale absmax / 127."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 127.0  # [M, 1]
    return torch.round(xf / scale).clamp(-128, 127).to(torch.int8), scale


def prepare_int8(weight: torch.Tensor, scale: torch.Tensor) -> Int8Weights:
    """Canonical int8 [N, K] weight and its per-channel scale ([N] or [N, 1]) -> the kernel's form."""
    return Int8Weights(weight.to(torch.int8).contiguous(), scale.reshape(-1).float().contiguous())


def int8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """Reference W8A8: x [M, K] -> [M, N] in x.dtype (int32 sums of int8 products, rescaled in float32)."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_rows_int8(x2)
    acc = (xq.to(torch.int64) @ weight.to(torch.int64).t()).float()  # [M, N], exact integer sums
    y = acc * xs * scale.reshape(1, -1).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def int8_linear(x: torch.Tensor, w: Int8Weights, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 matmul: x [..., K] -> [..., N] in x.dtype."""
    return int8_linear_ref(x, w.weight, w.scale, bias)


# ----------------------------------------------------------------------------------------------------- WNA16

@dataclass
class WNA16Weights:
    """A weight-only quantized matrix: `q` uint8 [N, K] (values < 2^bits), `scales` float [N, G], `zeros` uint8
    [N, G]; `perm` int64 [K] or None: the input columns in group order (act order), applied to x first."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    bits: int
    perm: torch.Tensor | None = None


def group_index(in_features: int, group_size: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    """int64 [K]: the group of every input column (g_idx as given, else k // group_size)."""
    if g_idx is not None:
        return g_idx.to(torch.int64)
    return torch.arange(in_features, dtype=torch.int64) // group_size


def dequantize_wna16_ref(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                         g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Canonical q [N, K], scales [N, G], zeros [N, G] (+ g_idx [K]) -> float32 W [N, K] = (q - z) * s."""
    groups = group_index(q.shape[1], group_size, g_idx).to(q.device)  # [K]
    z = zeros.to(torch.float32)[:, groups]  # [N, K]
    s = scales.to(torch.float32)[:, groups]  # [N, K]
    return (q.to(torch.float32) - z) * s


def wna16_linear_ref(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                     g_idx: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """Reference weight-only matmul: x [..., K] -> [..., N] in x.dtype, computed in float32."""
    w = dequantize_wna16_ref(q, scales, zeros, group_size, g_idx)
    y = F.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


def prepare_wna16(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, bits: int,
                  g_idx: torch.Tensor | None = None) -> WNA16Weights:
    """Canonical q / scales / zeros (+ act-order g_idx) -> the kernel's form. With a g_idx that is not k // group
    size the columns are sorted by group (`perm`), so every group is contiguous."""
    if bits not in (4, 8):
        raise ValueError(f"weight-only quantization with {bits} bits is not supported (4 or 8)")
    perm = None
    if g_idx is not None:
        groups = g_idx.to(torch.int64)
        if not torch.equal(groups, torch.arange(q.shape[1], device=q.device) // group_size):
            perm = torch.argsort(groups, stable=True)
            q = q[:, perm]
    return WNA16Weights(q.to(torch.uint8).contiguous(), scales.contiguous(), zeros.to(torch.uint8).contiguous(),
                        group_size, bits, perm)


def wna16_linear(x: torch.Tensor, w: WNA16Weights, bias: torch.Tensor | None) -> torch.Tensor:
    """Weight-only matmul: x [..., K] -> [..., N] in x.dtype."""
    if w.perm is not None:
        x = x.index_select(-1, w.perm)
    return wna16_linear_ref(x, w.q, w.scales, w.zeros, w.group_size, None, bias)


# ----------------------------------------------------------------------------------------------------- FP8

@dataclass
class FP8Weights:
    """An FP8 matrix: `weight` float8_e4m3fn [N, K]; `scale` float32 [] (tensor), [N] (channel) or [N/bn, K/bk]
    (`block` = (bn, bk)). Activations: `act` "token" / "group" (dynamic, `act_group` columns a group) or "static"
    (`input_scale`, one per tensor)."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None
    act: str
    act_group: int = 0
    input_scale: torch.Tensor | None = None


def quantize_fp8_ref(x: torch.Tensor, act: str, act_group: int = 0,
                     input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float -> float32 [M, K]: x rounded through float8_e4m3fn with a dynamic per-token / per-group or a
    static scale, then scaled back (the values an FP8 GEMM would multiply)."""
    xf = x.float()
    if act == "static":
        s = input_scale.float().reshape(1, 1)
    elif act == "token":
        s = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # [M, 1]
    elif act == "group":
        g = xf.reshape(xf.shape[0], -1, act_group)  # [M, K/g, g]
        s = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        q = (g / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
        return q.reshape_as(xf)
    else:
        raise ValueError(f"unknown FP8 activation scheme {act!r}")
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s


def dequantize_fp8_ref(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float8 W [N, K] and its scale -> float32 [N, K]."""
    w = weight.float()
    if block is None:
        return w * (scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float())
    bn, bk = block
    s = scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:w.shape[0], :w.shape[1]]  # [N, K]
    return w * s


def fp8_linear_ref(x: torch.Tensor, w: FP8Weights, bias: torch.Tensor | None) -> torch.Tensor:
    """Reference FP8 matmul: x [..., K] -> [..., N] in x.dtype, computed in float32."""
    x2 = x.reshape(-1, x.shape[-1])
    xq = quantize_fp8_ref(x2, w.act, w.act_group, w.input_scale)
    y = F.linear(xq, dequantize_fp8_ref(w.weight, w.scale, w.block), None if bias is None else bias.float())
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def prepare_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, act: str,
                act_group: int = 0, input_scale: torch.Tensor | None = None) -> FP8Weights:
    """float8_e4m3fn [N, K] weight, its scale and the activation scheme -> the kernel's form."""
    return FP8Weights(weight.contiguous(), scale.float().contiguous(), block, act, act_group,
                      None if input_scale is None else input_scale.float())


def fp8_linear(x: torch.Tensor, w: FP8Weights, bias: torch.Tensor | None) -> torch.Tensor:
    """FP8 matmul: x [..., K] -> [..., N] in x.dtype."""
    return fp8_linear_ref(x, w, bias)
