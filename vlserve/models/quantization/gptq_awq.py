"""GPTQ (`quant_method: "gptq"`, as GPTQModel writes it) and AWQ (`quant_method: "awq"`, GEMM packing) checkpoints.

GPTQ, per linear: `qweight` int32 [I * b / 32, O] (values packed along the input, element i of a word in bits
[b * i, b * (i + 1))), `qzeros` int32 [G, O * b / 32] (packed along the output; the v1 format
`checkpoint_format: "gptq"` stores zero - 1, v2 stores the zero), `scales` float16 [G, O], `g_idx` int32 [I] (the
group of every input column; with `desc_act` not in column order).
AWQ, per linear: `qweight` int32 [I, O / 8] and `qzeros` int32 [G, O / 8], both packed along the output with the
nibbles interleaved (`packing.AWQ_ORDER`), `scales` float16 [G, O]; 4 bits, zero points always stored.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from vlserve.kernels.quant_linear import prepare_wna16
from vlserve.models.quantization.base import (
    LinearScheme,
    QuantizationConfig,
    QuantParamLayout,
    add_quant_param,
    check_divides,
)
from vlserve.models.quantization.packing import AWQ_ORDER, unpack_int32
from vlserve.models.quantization.schemes import WNA16Scheme, remove_weight, replace_params


class _PackedGroupScheme(WNA16Scheme):
    """The parameters GPTQ and AWQ share: [G, O] scales, packed zero points along the output."""

    def _add_group_params(self, layer: nn.Module, groups: int, group: int, zero_div: int) -> None:
        input_dim = 0 if self.group_size and self.group_size > 0 else None  # per-channel: not along the input
        add_quant_param(
            layer,
            "qzeros",
            (groups, layer.out_features // zero_div),
            torch.int32,
            QuantParamLayout(output_dim=1, output_div=zero_div, input_dim=input_dim, input_div=group),
        )
        add_quant_param(
            layer,
            "scales",
            (groups, layer.out_features),
            torch.float32,
            QuantParamLayout(output_dim=1, input_dim=input_dim, input_div=group),
        )

    def _check(self, layer: nn.Module) -> tuple[int, int]:
        group = self.group_size_for(layer.in_features)
        check_divides(f"{type(layer).__name__} input size", layer.in_features, group, f"{self.method} group_size")
        check_divides(
            f"{type(layer).__name__} output size",
            layer.out_features,
            32 // self.bits,
            f"{self.method} zero-point packing",
        )
        return layer.in_features // group, group


class GPTQScheme(_PackedGroupScheme):
    """GPTQ 4 / 8-bit weights, act order or not, v1 (zero - 1) or v2 zero points."""

    def __init__(self, bits: int, group_size: int, desc_act: bool, zero_offset: int) -> None:
        super().__init__(bits, group_size, "gptq")
        self.desc_act, self.zero_offset = desc_act, zero_offset

    def create_weights(self, layer: nn.Module) -> None:
        groups, group = self._check(layer)
        per_word = 32 // self.bits
        check_divides("input size", layer.in_features, per_word, f"gptq {self.bits}-bit packing")
        if self.desc_act and getattr(layer, "shards_input", False):
            raise ValueError("gptq: desc_act (act-order) weights cannot be split by input over tensor-parallel ranks")
        remove_weight(layer)
        add_quant_param(
            layer,
            "qweight",
            (layer.in_features // per_word, layer.out_features),
            torch.int32,
            QuantParamLayout(output_dim=1, input_dim=0, input_div=per_word),
        )
        self._add_group_params(layer, groups, group, per_word)
        add_quant_param(
            layer,
            "g_idx",
            (layer.in_features,),
            torch.int32,
            QuantParamLayout(output_dim=None, input_dim=0, same_in_pieces=True),
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = unpack_int32(layer.qweight.data, self.bits, 0, layer.in_features).t()  # [O, I]
        zeros = unpack_int32(layer.qzeros.data, self.bits, 1, layer.out_features).t()  # [O, G]
        zeros = ((zeros.to(torch.int16) + self.zero_offset) & ((1 << self.bits) - 1)).to(torch.uint8)
        scales = layer.scales.data.t()  # [O, G]
        g_idx = layer.g_idx.data if self.desc_act else None
        prepared = prepare_wna16(
            q, scales, zeros, self.group_size_for(layer.in_features), self.bits, g_idx, keep_canonical=False
        )
        replace_params(layer, ("qweight", "qzeros", "scales", "g_idx"), prepared)


class AWQScheme(_PackedGroupScheme):
    """AWQ GEMM: 4-bit weights with zero points, nibbles interleaved along the output."""

    def __init__(self, group_size: int) -> None:
        super().__init__(4, group_size, "awq")

    def create_weights(self, layer: nn.Module) -> None:
        groups, group = self._check(layer)
        remove_weight(layer)
        add_quant_param(
            layer,
            "qweight",
            (layer.in_features, layer.out_features // 8),
            torch.int32,
            QuantParamLayout(output_dim=1, output_div=8, input_dim=0),
        )
        self._add_group_params(layer, groups, group, 8)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = unpack_int32(layer.qweight.data, 4, 1, layer.out_features, AWQ_ORDER).t()  # [O, I]
        zeros = unpack_int32(layer.qzeros.data, 4, 1, layer.out_features, AWQ_ORDER).t()  # [O, G]
        prepared = prepare_wna16(
            q, layer.scales.data.t(), zeros, self.group_size_for(layer.in_features), 4, keep_canonical=False
        )
        replace_params(layer, ("qweight", "qzeros", "scales"), prepared)


def _skipped(name: str, patterns: list[str]) -> bool:
    """Whether a module name is in a not-quantized list (plain names match as a dotted component run)."""
    for p in patterns:
        if p.startswith("re:") or p.startswith("-:"):
            if re.match(p.split(":", 1)[1], name):
                return True
        elif name == p or f".{p}." in f".{name}." or name.startswith(p + "."):
            return True
    return False


class GPTQConfig(QuantizationConfig):
    """A GPTQ `quantization_config` (bits, group_size, desc_act, sym, checkpoint_format)."""

    method = "gptq"
    quantized_suffixes = (".qweight",)

    def __init__(self, cfg: dict) -> None:
        bits = int(cfg.get("bits", 4))
        fmt = cfg.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported (gptq or gptq_v2)")
        if cfg.get("dynamic"):
            raise ValueError("gptq 'dynamic' per-module overrides are not supported")
        self.skip = list(cfg.get("modules_to_not_convert") or [])
        self.scheme = GPTQScheme(
            bits, int(cfg.get("group_size", 128)), bool(cfg.get("desc_act", False)), 1 if fmt == "gptq" else 0
        )

    def scheme_for(self, hf_module_name: str) -> LinearScheme | None:
        return None if _skipped(hf_module_name, self.skip) else self.scheme

    def describe(self) -> str:
        return self.scheme.describe() + (" act-order" if self.scheme.desc_act else "")


class AWQConfig(QuantizationConfig):
    """An AWQ `quantization_config` (GEMM version, 4 bits, zero points)."""

    method = "awq"
    quantized_suffixes = (".qweight",)

    def __init__(self, cfg: dict) -> None:
        bits = int(cfg.get("bits", cfg.get("w_bit", 4)))
        version = str(cfg.get("version", "gemm")).lower()
        if bits != 4:
            raise ValueError(f"awq bits={bits} is not supported (4)")
        if version != "gemm":
            raise ValueError(f"awq version {version!r} is not supported (gemm)")
        if not cfg.get("zero_point", True):
            raise ValueError("awq zero_point=false is not supported")
        self.skip = list(cfg.get("modules_to_not_convert") or [])
        self.scheme = AWQScheme(int(cfg.get("group_size", cfg.get("q_group_size", 128))))

    def scheme_for(self, hf_module_name: str) -> LinearScheme | None:
        return None if _skipped(hf_module_name, self.skip) else self.scheme
