"""INT8 media encoders (`mm_encoder_quantization="int8"`): the float linears of a model's encoder parts (vision and
audio towers' attention and MLP projections, patch mergers, projectors) quantized once loaded to W8A8, weights int8
with a symmetric absmax scale per output channel, activations int8 per token at run time, through the decoder's
W8A8 kernels (`kernels.quant_linear.int8_linear`: AMX int8 tiles where the CPU has them).

One walk (`quantize_encoder_linears`) swaps each `PackableLinear`'s float weight for `Int8Weights` and gives the
layer `EncoderInt8Scheme`, so the towers' code is unchanged. Patch embeddings (convolutions), norms, position
embeddings and biases stay float; so do linears whose matrix another library's code reads directly (`keep_weight`:
timm-built towers).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from vlserve.kernels.packed_linear import PackableLinear
from vlserve.kernels.quant_linear import prepare_int8
from vlserve.models.quantization.schemes import Int8Scheme, replace_params

logger = logging.getLogger(__name__)

ENCODER_QUANTIZATION_METHODS = ("int8",)
INT8_WEIGHT_MAX = 127.0  # weights use the symmetric range [-127, 127]


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float W [N, K] -> (int8 [N, K], float32 scale [N]) with W ~ q * scale[:, None]: symmetric per output channel,
    scale = absmax(row) / 127, values rounded to nearest."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-10) / INT8_WEIGHT_MAX  # [N]
    q = torch.round(w / scale[:, None]).clamp(-INT8_WEIGHT_MAX, INT8_WEIGHT_MAX).to(torch.int8)  # [N, K]
    return q, scale


class EncoderInt8Scheme(Int8Scheme):
    """W8A8 INT8 for a float linear quantized at load (no checkpoint tensors of its own): the float weight loads as
    usual and becomes int8 in `process_weights_after_loading`."""

    method = "mm-encoder int8"

    def create_weights(self, layer: nn.Module) -> None:
        """Nothing to create: the layer keeps its float `weight` until it is quantized."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_weight_int8(layer.weight.data)
        replace_params(layer, (), prepare_int8(q, scale, keep_canonical=False))


def encoder_linears(model: nn.Module) -> list[tuple[str, PackableLinear]]:
    """(name, layer) of every float `PackableLinear` in `model.encoder_parts()` that can be quantized: not
    quantized already, holding its weight, and not read directly by another library (`keep_weight`)."""
    names = {id(m): name for name, m in model.named_modules()}
    found = []
    for part in model.encoder_parts():
        part_name = names.get(id(part), type(part).__name__)
        for rel, layer in part.named_modules():
            if (
                isinstance(layer, PackableLinear)
                and layer.quant_scheme is None
                and layer.weight is not None
                and not getattr(layer, "keep_weight", False)
            ):
                found.append((f"{part_name}.{rel}" if rel else part_name, layer))
    return found


def quantize_encoder_linears(model: nn.Module, method: str) -> int:
    """Quantize the encoder parts' linears of a loaded model (`encoder_linears`) with `method` ("int8"); how many.
    ValueError on another method, a model without encoder parts, or weights off the CPU (the INT8 towers run on the
    CPU kernels only for now)."""
    if method not in ENCODER_QUANTIZATION_METHODS:
        raise ValueError(
            f"mm_encoder_quantization={method!r} is not supported; choose one of {', '.join(ENCODER_QUANTIZATION_METHODS)}"
        )
    if not model.encoder_parts():
        raise ValueError(f"mm_encoder_quantization needs a multimodal model; {type(model).__name__} has no encoder")
    layers = encoder_linears(model)
    off_cpu = [(name, layer.weight.device) for name, layer in layers if layer.weight.device.type != "cpu"]
    if off_cpu:
        raise ValueError(
            f"mm_encoder_quantization={method!r} runs on the CPU only for now; {off_cpu[0][0]} is on {off_cpu[0][1]}"
        )
    scheme = EncoderInt8Scheme()
    for _, layer in layers:
        scheme.process_weights_after_loading(layer)
        layer.quant_scheme = scheme
    left = sum(
        1
        for part in model.encoder_parts()
        for m in part.modules()
        if isinstance(m, PackableLinear) and m.quant_scheme is None
    )
    logger.info(
        "mm_encoder_quantization=%s: %d encoder linears quantized to W8A8 int8%s",
        method,
        len(layers),
        f" ({left} left float: read directly by another library's code)" if left else "",
    )
    return len(layers)
