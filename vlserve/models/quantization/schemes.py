"""The kernel side shared by the formats: a W8A8 INT8, a weight-only (WNA16) and an FP8 linear scheme. Each format
(compressed-tensors, GPTQ, AWQ) subclasses one of them with its own parameters and unpacking; all of them end in
`layer.quant_weights`, the kernel's form (`kernels.quant_linear`), and multiply through it."""

from __future__ import annotations

import torch
from torch import nn

from vlserve.kernels.quant_linear import WNA16Weights, fp8_linear, int8_linear, int8_linear_silu_mul, wna16_linear
from vlserve.kernels.quant_linear_cuda import (
    TritonWNA16Weights,
    fp8_linear_cuda,
    int8_linear_cuda,
    prepare_wna16_cuda,
    wna16_linear_cuda,
)
from vlserve.models.quantization.base import LinearScheme


def replace_params(layer: nn.Module, drop: tuple[str, ...], prepared) -> None:
    """Set `layer.quant_weights = prepared` (on CUDA, a WNA16 matrix repacked for the Triton kernel) and remove the
    checkpoint-form parameters `drop` (and `weight`)."""
    for name in drop:
        if name in layer._parameters:
            del layer._parameters[name]
    layer.register_parameter("weight", None)
    if isinstance(prepared, WNA16Weights) and prepared.q is not None and prepared.q.is_cuda:
        prepared = prepare_wna16_cuda(prepared)
    layer.quant_weights = prepared


def remove_weight(layer: nn.Module) -> None:
    """Drop the layer's float `weight` parameter (a quantized layer never holds one)."""
    layer.register_parameter("weight", None)


class WNA16Scheme(LinearScheme):
    """Integer weights (4 or 8 bits) in groups along the input dim with float scales; float activations."""

    def __init__(self, bits: int, group_size: int | None, method: str) -> None:
        if bits not in (4, 8):
            raise ValueError(f"{method}: {bits}-bit weights are not supported (4 or 8)")
        self.bits, self.group_size, self.method = bits, group_size, method

    def group_size_for(self, in_features: int) -> int:
        """The group size along this layer's input (per-channel = one group of the whole row)."""
        return self.group_size if self.group_size and self.group_size > 0 else in_features

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = layer.quant_weights
        if isinstance(w, TritonWNA16Weights):
            return wna16_linear_cuda(x, w, bias)
        return wna16_linear(x, w, bias)

    def describe(self) -> str:
        return f"{self.method} w{self.bits}a16 g{self.group_size or 'channel'}"


class Int8Scheme(LinearScheme):
    """INT8 weights with a scale per output channel; activations quantized to INT8 per token at run time."""

    quantizes_activations = True

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = layer.quant_weights
        if x.is_cuda:
            return int8_linear_cuda(x, w.weight, w.scale, bias)
        return int8_linear(x, w, bias)

    def apply_silu_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, intermediate: int
    ) -> torch.Tensor | None:
        return None if x.is_cuda else int8_linear_silu_mul(x, layer.quant_weights, bias, intermediate)

    def describe(self) -> str:
        return f"{self.method} w8a8 int8"


class FP8Scheme(LinearScheme):
    """FP8 (e4m3) weights with per-tensor, per-channel or block scales; FP8 activations, dynamic or static."""

    quantizes_activations = True

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = layer.quant_weights
        if x.is_cuda:
            return fp8_linear_cuda(x, w.weight, w.scale, w.block, w.act, w.act_group, w.input_scale, bias)
        return fp8_linear(x, w, bias)

    def describe(self) -> str:
        return f"{self.method} fp8"
