"""Quantized checkpoints: compressed-tensors (INT8 W8A8, FP8, INT4/INT8 weight-only), GPTQ and AWQ.

The loader calls three functions, and nothing else in the model code knows about formats:
1. `get_quantization_config(hf_config, requested)`: the checkpoint's `quantization_config`, parsed (None when the
   checkpoint is not quantized); `requested` (`--quantization`) must agree with it.
2. `apply_quantization(decoder, decoder_prefix, config, checkpoint_names)`, on the model built on the meta device:
   every linear layer of the language decoder that the checkpoint stores quantized gets its format's scheme
   (`layer.quant_scheme`), which swaps `weight` for the format's tensors. Which layers are quantized is read from
   the checkpoint's tensor names (so `ignore` lists are honored as the tool applied them); quantized tensors of
   any other module (a vision tower, the LM head) are refused with their names.
3. `process_quantized_weights(model)` once every tensor is loaded: the schemes turn them into their kernels' form.

Apart from the checkpoint's format, `encoder_int8.quantize_encoder_linears` quantizes a loaded model's float tower
and projector linears to W8A8 INT8 (`mm_encoder_quantization="int8"`).
"""

from __future__ import annotations

import logging

from torch import nn

from vlserve.models.quantization.base import LinearScheme, QuantizationConfig
from vlserve.models.quantization.compressed_tensors import CompressedTensorsConfig
from vlserve.models.quantization.gptq_awq import AWQConfig, GPTQConfig

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    "compressed-tensors": CompressedTensorsConfig,
    "gptq": GPTQConfig,
    "awq": AWQConfig,
}
_ALIASES = {"compressed_tensors": "compressed-tensors"}


def get_quantization_config(hf_config, requested: str | None = None) -> QuantizationConfig | None:
    """The parsed `quantization_config` of `hf_config` (None when absent); ValueError on an unknown method or when
    `requested` names another one than the checkpoint's."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is not None and not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
    requested = _ALIASES.get(requested, requested) if requested else None
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization={requested!r} is not supported; choose one of {', '.join(QUANTIZATION_METHODS)}"
        )
    if raw is None:
        if requested is not None:
            raise ValueError(
                f"quantization={requested!r} was requested but the checkpoint's config.json has no "
                "quantization_config (vlserve runs checkpoints that a quantization tool wrote)"
            )
        return None
    method = _ALIASES.get(str(raw.get("quant_method")), str(raw.get("quant_method")))
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization_config.quant_method {raw.get('quant_method')!r} is not supported; "
            f"supported: {', '.join(QUANTIZATION_METHODS)}"
        )
    if requested is not None and requested != method:
        raise ValueError(
            f"quantization={requested!r} does not match the checkpoint's quantization_config.quant_method {method!r}"
        )
    return QUANTIZATION_METHODS[method](raw)


def _hf_names(rel_name: str, layer: nn.Module, prefix: str) -> list[str]:
    """The checkpoint module names a (possibly fused) layer of ours is loaded from."""
    pieces = list(getattr(layer, "piece_offsets", {}) or [])
    if not pieces:
        return [prefix + rel_name]
    parent = rel_name.rpartition(".")[0]
    return [prefix + (f"{parent}.{p}" if parent else p) for p in pieces]


def quantized_modules(config: QuantizationConfig, checkpoint_names) -> set[str]:
    """Checkpoint module names whose tensors are stored quantized (by the format's tensor-name suffixes)."""
    found = set()
    for name in checkpoint_names:
        for suffix in config.quantized_suffixes:
            if name.endswith(suffix):
                found.add(name[: -len(suffix)])
    return found


def apply_quantization(decoder: nn.Module, decoder_prefix: str, config: QuantizationConfig, checkpoint_names) -> int:
    """Give every linear layer of `decoder` (whose checkpoint names start with `decoder_prefix`) that the
    checkpoint stores quantized its scheme; how many layers. ValueError when fused projections disagree, when the
    config leaves a stored-quantized module unquantized, or when quantized modules lie outside the decoder."""
    stored = quantized_modules(config, checkpoint_names)
    claimed: set[str] = set()
    count = 0
    activations = False
    for rel, layer in decoder.named_modules():
        if not hasattr(layer, "quant_scheme") or layer.weight is None:
            continue
        names = _hf_names(rel, layer, decoder_prefix)
        quantized = [n in stored for n in names]
        if not any(quantized):
            continue
        if not all(quantized):
            raise ValueError(f"{config.method}: the fused projections {names} are stored partly quantized")
        schemes = {id(config.scheme_for(n)): config.scheme_for(n) for n in names}
        if len(schemes) != 1 or None in schemes.values():
            raise ValueError(
                f"{config.method}: {names} are stored quantized but quantization_config gives them "
                f"{'different schemes' if len(schemes) > 1 else 'no scheme (ignore list)'}"
            )
        scheme: LinearScheme = next(iter(schemes.values()))
        layer.quant_device = layer.weight.device
        try:
            scheme.create_weights(layer)
        except ValueError as e:
            raise ValueError(f"{', '.join(names)}: {e}") from e
        layer.quant_scheme = scheme
        activations |= scheme.quantizes_activations
        claimed.update(names)
        count += 1
    others = sorted(stored - claimed)
    if others:
        raise ValueError(
            f"{config.method}: the checkpoint stores quantized weights for modules vlserve runs "
            f"unquantized only (vision towers, projectors, the LM head): {others[:5]}; quantize the "
            "model with them in the recipe's ignore list"
        )
    if activations:  # a last-bit difference in a norm's output can land on another grid value
        for module in decoder.modules():
            if hasattr(module, "float32_on_torch"):
                module.float32_on_torch = True
    if count:
        logger.info("quantized checkpoint: %s, %d linear layers", config.describe(), count)
    return count


def process_quantized_weights(model: nn.Module) -> None:
    """After loading: every quantized layer's scheme turns its checkpoint tensors into its kernel's form."""
    for layer in model.modules():
        scheme = getattr(layer, "quant_scheme", None)
        if scheme is not None:
            scheme.process_weights_after_loading(layer)
