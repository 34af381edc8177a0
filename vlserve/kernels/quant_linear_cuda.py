"""CUDA matmuls for the quantized linear layers of `quant_linear` (same arguments and semantics as its `*_ref`s):
- W8A8 INT8 (`int8_linear_cuda`): x quantized per token to int8 (`quantize_rows_int8`: scale absmax / 127.5), then
  `torch._int_mm` (int32 sums) and a float32 rescale by the token and channel scales.
- FP8 (`fp8_linear_cuda`): x quantized to float8_e4m3fn per token / statically, then `torch._scaled_mm` with the
  token (row-wise) or tensor scale of x and the channel (row-wise) or tensor scale of W, on sm89+. Block-scaled
  weights: torch 2.14's `_scaled_mm` (v1) has no recipe argument; its v2 (`torch.nn.functional.scaled_mm` ->
  `torch._scaled_mm_v2`, `ScalingType.BlockWise1x128` / `BlockWise128x128`) does blockwise through cuBLAS, on sm90
  only and with CUDA >= 12.9, for x scaled per 1x128 group and W per 128x128 block (DeepSeek-V3 style). That is
  used for exactly that case (act "group" with 128 columns, block (128, 128), K and N multiples of 128); every
  other FP8 case dequantizes W to x.dtype once per call and runs F.linear on x rounded through fp8 (`_fp8_fallback`).
- WNA16 (`prepare_wna16_cuda` / `wna16_linear_cuda`): the Triton kernel of `triton_wna16` (dequantizes inside its
  K loop), imported when first used, so this module imports without triton and on CPU-only machines.

`fp8_path` / `int8_path` name the route a call takes (the benchmark prints them). Capability checks go through
`_capability`, which tests replace to drive the `_scaled_mm` routes with torch's CPU implementations.

Where this has run: on CPU only. The `_int_mm` and row-/tensor-wise `_scaled_mm` calls were checked against the
references with torch's CPU kernels, the WNA16 route under Triton's interpreter. No line here has executed on a GPU
yet; the blockwise `scaled_mm` call (layouts taken from torch 2.14's own tests) has never executed at all.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlserve.kernels.quant_linear import FP8_MAX, WNA16Weights, dequantize_fp8_ref, quantize_fp8_ref, quantize_rows_int8

INT_MM_MIN_M = 17  # torch._int_mm on CUDA needs M > 16 rows, K and N multiples of 8
_blockwise_failed = False  # set once the blockwise scaled_mm raised: later calls go straight to the fallback


def _capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for any other device."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def _cuda_version() -> tuple[int, int]:
    version = torch.version.cuda or "0.0"
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def _finish(y: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    # y [M, N] (any float dtype) -> x's leading dims, x.dtype, bias added in float32 when given
    if bias is not None:
        y = y.float() + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


# ----------------------------------------------------------------------------------------------------- W8A8 INT8


def int8_path(m: int, k: int, n: int) -> str:
    """ "int_mm" (rows padded to 17 when M <= 16) or "float" when K or N is not a multiple of 8."""
    return "int_mm" if k % 8 == 0 and n % 8 == 0 else "float"


def int8_linear_cuda(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """W8A8 matmul through torch._int_mm: x [..., K] float, weight int8 [N, K], scale [N] -> [..., N] in x.dtype.
    M <= 16 pads x with zero rows up to 17; K or N not a multiple of 8 falls back to a float32 matmul of the int8
    values (exact while the partial sums stay below 2^24)."""
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)  # [M, K]
    m = x2.shape[0]
    xq, xs = quantize_rows_int8(x2)  # int8 [M, K], float32 [M, 1]
    if int8_path(m, k, n) == "int_mm":
        if m < INT_MM_MIN_M:
            xq = F.pad(xq, (0, 0, 0, INT_MM_MIN_M - m))  # [17, K]
        acc = torch._int_mm(xq, weight.t())[:m]  # int32 [M, N]
    else:
        acc = xq.float() @ weight.float().t()  # [M, N]
    y = acc.float() * xs * scale.reshape(1, -1).float()
    return _finish(y, bias, x)


# ----------------------------------------------------------------------------------------------------- FP8


def fp8_path(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    act: str,
    act_group: int = 0,
) -> str:
    """The route `fp8_linear_cuda` takes: "tensorwise" / "rowwise" (`_scaled_mm`), "blockwise" (`scaled_mm` v2) or
    "dequant" (W dequantized to x.dtype, F.linear)."""
    cap = _capability(x.device)
    n, k = weight.shape
    if cap is None or cap < (8, 9) or k % 16 or n % 16:
        return "dequant"
    if block is None:
        if act == "static" and scale.numel() == 1:
            return "tensorwise"
        if act in ("static", "token"):
            return "rowwise"
        return "dequant"
    if (
        tuple(block) == (128, 128)
        and act == "group"
        and act_group == 128
        and cap[0] == 9
        and _cuda_version() >= (12, 9)
        and k % 128 == 0
        and n % 128 == 0
        and not _blockwise_failed
    ):
        return "blockwise"
    return "dequant"


def _quantize_fp8(x2: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x2 [M, K] / scale (broadcastable) -> float8_e4m3fn [M, K], saturated at +-448
    return (x2.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _token_scales(x2: torch.Tensor, group: int = 0) -> torch.Tensor:
    # dynamic scales as quantize_fp8_ref: [M, 1] per token, or [M, K / group] per group of columns
    xf = x2.float()
    if group:
        xf = xf.reshape(xf.shape[0], -1, group)  # [M, K/g, g]
        return xf.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    return xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX


def _fp8_fallback(
    x2: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block,
    act: str,
    act_group: int,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    # x2 [M, K] -> [M, N] in x2.dtype: x rounded through fp8 as the reference does, W dequantized once
    xq = quantize_fp8_ref(x2, act, act_group, input_scale).to(x2.dtype)  # [M, K]
    w = dequantize_fp8_ref(weight, scale, block).to(x2.dtype)  # [N, K]
    return F.linear(xq, w)


def _scaled_mm(xq, weight, x_scale, w_scale, bias, out_dtype):
    # xq fp8 [M, K] row-major, weight fp8 [N, K] (its .t() is the column-major [K, N] that cuBLAS wants)
    use_bias = bias is not None and bias.dtype == out_dtype == torch.bfloat16
    y = torch._scaled_mm(
        xq, weight.t(), scale_a=x_scale, scale_b=w_scale, bias=bias if use_bias else None, out_dtype=out_dtype
    )
    return y, use_bias


def _blockwise(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # DeepSeek-style FP8: x per 1x128 group, W per 128x128 block -> [M, N] bfloat16. Scale layouts as cuBLAS wants:
    # x's [M, K/128] column-major; W's [N/128, K/128] padded to a multiple of 4 K-blocks, passed transposed.
    xs = _token_scales(x2, 128)  # [M, K/128]
    xq = _quantize_fp8(x2, xs.repeat_interleave(128, dim=1))  # [M, K]
    kb = scale.shape[1]
    ws = F.pad(scale.float(), (0, (-kb) % 4)).t()  # [L4, N/128] view of a contiguous [N/128, L4]
    xs_cm = xs.t().contiguous().t()  # [M, K/128], stride (1, M)
    return F.scaled_mm(
        xq,
        weight.t(),
        xs_cm,
        F.ScalingType.BlockWise1x128,
        ws,
        F.ScalingType.BlockWise128x128,
        swizzle_a=F.SwizzleType.NO_SWIZZLE,
        swizzle_b=F.SwizzleType.NO_SWIZZLE,
        output_dtype=torch.bfloat16,
    )


def fp8_linear_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    act: str,
    act_group: int = 0,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP8 matmul: x [..., K] float, weight float8_e4m3fn [N, K], scale [] / [N] / [N/bn, K/bk] -> [..., N] in
    x.dtype (routes: `fp8_path`)."""
    global _blockwise_failed
    k = x.shape[-1]
    x2 = x.reshape(-1, k)  # [M, K]
    path = fp8_path(x, weight, scale, block, act, act_group)
    if path == "blockwise":
        try:
            return _finish(_blockwise(x2, weight, scale), bias, x)
        except (RuntimeError, NotImplementedError, ValueError) as err:
            _blockwise_failed = True
            warnings.warn(
                f"blockwise scaled_mm failed ({err}); FP8 block-scaled layers dequantize from now on", stacklevel=2
            )
            path = "dequant"
    if path == "dequant":
        return _finish(_fp8_fallback(x2, weight, scale, block, act, act_group, input_scale), bias, x)
    m, n = x2.shape[0], weight.shape[0]
    if path == "tensorwise":
        xs = input_scale.float().reshape(())
        out_dtype = x.dtype
        y, used = _scaled_mm(_quantize_fp8(x2, xs), weight, xs, scale.float().reshape(()), bias, out_dtype)
    else:
        # row-wise: scale_a [M, 1], scale_b [1, N], both float32 and contiguous; bf16 output (all sm89+ kernels
        # have it; fp16 / fp32 outputs depend on the cuBLAS version)
        if act == "static":
            xs = input_scale.float().reshape(1, 1).expand(m, 1).contiguous()
        else:
            xs = _token_scales(x2)  # [M, 1]
        ws = scale.float().reshape(1, -1).expand(1, n).contiguous()  # [1, N]
        y, used = _scaled_mm(_quantize_fp8(x2, xs), weight, xs, ws, bias, torch.bfloat16)
    return _finish(y, None if used else bias, x)


# ----------------------------------------------------------------------------------------------------- WNA16


@dataclass
class TritonWNA16Weights:
    """A WNA16 matrix in the Triton kernel's layout: `qweight` int32 [ceil(K * bits / 32), N], `scales` [G, N],
    `zeros` uint8 [G, N]; `perm` int64 [K] or None (act order, applied to x's columns first)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    bits: int
    perm: torch.Tensor | None = None


def _wna16_module():
    return importlib.import_module("vlserve.kernels.triton_wna16")


def prepare_wna16_cuda(w: WNA16Weights) -> TritonWNA16Weights:
    """`quant_linear.prepare_wna16`'s canonical weights -> the Triton kernel's packed layout (run once)."""
    qweight, scales, zeros = _wna16_module().pack_wna16_for_triton(w.q, w.scales, w.zeros, w.bits)
    return TritonWNA16Weights(qweight, scales, zeros, w.group_size, w.bits, w.perm)


def wna16_linear_cuda(x: torch.Tensor, w: TritonWNA16Weights, bias: torch.Tensor | None) -> torch.Tensor:
    """Weight-only matmul through the Triton kernel: x [..., K] -> [..., N] in x.dtype."""
    if w.perm is not None:
        x = x.index_select(-1, w.perm)
    return _wna16_module().wna16_matmul_triton(x, w.qweight, w.scales, w.zeros, w.group_size, w.bits, bias)
