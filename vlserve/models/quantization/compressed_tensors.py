"""compressed-tensors checkpoints, as llm-compressor writes them (`quant_method: "compressed-tensors"`).

Supported, per config group (`config_groups.*`: `targets`, `weights`, `input_activations`, `format`):
- weight-only INT4 / INT8 (`pack-quantized`: `weight_packed` int32 [O, I * b / 32], values + 2^(b-1) packed along
  the input, element i of a word in bits [b * i, b * (i + 1)); `weight_scale` [O, I / g] or [O, 1];
  asymmetric: `weight_zero_point` [O * b / 32, I / g] packed the same way along the output; act order:
  `weight_g_idx` [I]); `naive-quantized` / `int-quantized` weight-only keep an int8 `weight` [O, I].
- W8A8 INT8 (`int-quantized`): int8 `weight` [O, I], `weight_scale` [O, 1] (or one per tensor), activations
  dynamic per token, symmetric.
- FP8 (`float-quantized`): float8_e4m3fn `weight` [O, I], `weight_scale` per tensor, per channel [O, 1] or per
  block [O / bn, I / bk]; activations dynamic per token or per group, or static (`input_scale`).
`ignore` lists (exact module names or `re:` patterns) leave modules unquantized. Anything else is a ValueError that
names the field.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from vlserve.kernels.quant_linear import prepare_fp8, prepare_int8, prepare_wna16
from vlserve.models.quantization.base import (
    LinearScheme,
    QuantizationConfig,
    QuantParamLayout,
    add_quant_param,
    check_divides,
)
from vlserve.models.quantization.packing import unpack_int32
from vlserve.models.quantization.schemes import FP8Scheme, Int8Scheme, WNA16Scheme, remove_weight, replace_params

METHOD = "compressed-tensors"
NO_DIMS = QuantParamLayout(output_dim=None, input_dim=None)


def _matches(target: str, name: str) -> bool:
    """A compressed-tensors target or ignore entry against a module name ("Linear" matches every linear)."""
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target


class CTWNA16(WNA16Scheme):
    """Weight-only INT4 / INT8 in compressed-tensors' pack-quantized (or int8 naive) form."""

    def __init__(self, bits: int, group_size: int | None, symmetric: bool, actorder: bool, packed: bool) -> None:
        super().__init__(bits, group_size, METHOD)
        self.symmetric, self.actorder, self.packed = symmetric, actorder, packed

    def create_weights(self, layer: nn.Module) -> None:
        out, inp = layer.out_features, layer.in_features
        group = self.group_size_for(inp)
        check_divides(f"{type(layer).__name__} input size", inp, group, f"{METHOD} group_size")
        groups = inp // group
        grouped = bool(self.group_size and self.group_size > 0)  # per-channel scales do not run along the input
        scale_layout = QuantParamLayout(input_dim=1 if grouped else None, input_div=group)
        remove_weight(layer)
        if self.packed:
            per_word = 32 // self.bits
            check_divides("input size", inp, per_word, f"{METHOD} {self.bits}-bit packing")
            add_quant_param(
                layer, "weight_packed", (out, inp // per_word), torch.int32, QuantParamLayout(input_div=per_word)
            )
            add_quant_param(layer, "weight_shape", (2,), torch.int64, NO_DIMS)
        else:
            add_quant_param(layer, "weight", (out, inp), torch.int8, QuantParamLayout())
        add_quant_param(layer, "weight_scale", (out, groups), torch.float32, scale_layout)
        if not self.symmetric:
            per_word = 32 // self.bits if self.packed else 1
            zp_layout = QuantParamLayout(output_div=per_word, input_dim=scale_layout.input_dim, input_div=group)
            add_quant_param(
                layer,
                "weight_zero_point",
                (-(-out // per_word), groups),
                torch.int32 if self.packed else torch.int8,
                zp_layout,
            )
        if self.actorder:
            if getattr(layer, "shards_input", False):
                raise ValueError(
                    f"{METHOD}: act-order (weight_g_idx) weights cannot be split by input over tensor-parallel ranks"
                )
            add_quant_param(
                layer,
                "weight_g_idx",
                (inp,),
                torch.int32,
                QuantParamLayout(output_dim=None, input_dim=0, same_in_pieces=True),
            )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        out, inp = layer.out_features, layer.in_features
        offset = 1 << (self.bits - 1)
        if self.packed:
            q = unpack_int32(layer.weight_packed.data, self.bits, 1, inp)  # [O, I] unsigned
        else:
            q = (layer.weight.data.to(torch.int16) + offset).to(torch.uint8)
        scales = layer.weight_scale.data  # [O, G]
        if self.symmetric:
            zeros = torch.full(scales.shape, offset, dtype=torch.uint8, device=q.device)
        elif self.packed:
            zeros = unpack_int32(layer.weight_zero_point.data, self.bits, 0, out)  # [O, G] unsigned
        else:
            zeros = (layer.weight_zero_point.data.to(torch.int16) + offset).to(torch.uint8)
        g_idx = layer.weight_g_idx.data if self.actorder else None
        prepared = prepare_wna16(q, scales, zeros, self.group_size_for(inp), self.bits, g_idx, keep_canonical=False)
        replace_params(
            layer, ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx"), prepared
        )


class CTInt8(Int8Scheme):
    """W8A8 INT8: int8 weights per channel (or per tensor), dynamic per-token INT8 activations."""

    method = METHOD

    def __init__(self, per_tensor: bool) -> None:
        self.per_tensor = per_tensor

    def create_weights(self, layer: nn.Module) -> None:
        remove_weight(layer)
        add_quant_param(layer, "weight", (layer.out_features, layer.in_features), torch.int8, QuantParamLayout())
        add_quant_param(
            layer,
            "weight_scale",
            (layer.out_features, 1),
            torch.float32,
            QuantParamLayout(input_dim=None, per_piece_scalar=self.per_tensor),
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        replace_params(
            layer, ("weight_scale",), prepare_int8(layer.weight.data, layer.weight_scale.data, keep_canonical=False)
        )


class CTFP8(FP8Scheme):
    """FP8 e4m3 weights (tensor / channel / block scales) with dynamic or static FP8 activations."""

    method = METHOD

    def __init__(self, strategy: str, block: tuple[int, int] | None, act: str, act_group: int) -> None:
        self.strategy, self.block, self.act, self.act_group = strategy, block, act, act_group

    def create_weights(self, layer: nn.Module) -> None:
        out, inp = layer.out_features, layer.in_features
        remove_weight(layer)
        add_quant_param(layer, "weight", (out, inp), torch.float8_e4m3fn, QuantParamLayout())
        if self.strategy == "block":  # held one scale row per output row: see QuantParamLayout.expand_rows
            bn, bk = self.block
            if getattr(layer, "shards_input", False):
                check_divides("input size of a rank", inp, bk, f"{METHOD} FP8 block")
            add_quant_param(
                layer,
                "weight_scale",
                (out, -(-inp // bk)),
                torch.float32,
                QuantParamLayout(input_div=bk, expand_rows=bn),
            )
        else:
            add_quant_param(
                layer,
                "weight_scale",
                (out, 1),
                torch.float32,
                QuantParamLayout(input_dim=None, per_piece_scalar=self.strategy == "tensor"),
            )
        if self.act == "static":
            add_quant_param(
                layer, "input_scale", (out,), torch.float32, QuantParamLayout(input_dim=None, per_piece_scalar=True)
            )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scale = layer.weight_scale.data
        input_scale = layer.input_scale.data.max().reshape(1) if self.act == "static" else None
        block = (1, self.block[1]) if self.strategy == "block" else None  # scales already expanded to rows
        prepared = prepare_fp8(
            layer.weight.data,
            scale if block else scale.reshape(-1),
            block,
            self.act,
            self.act_group,
            input_scale,
            keep_canonical=False,
        )
        replace_params(layer, ("weight_scale", "input_scale"), prepared)


def _scheme_of_group(name: str, group: dict, default_format: str | None) -> LinearScheme:
    """The scheme of one `config_groups` entry; ValueError naming what is not supported."""
    where = f"{METHOD} config_groups.{name}"
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    fmt = group.get("format") or default_format
    bits, wtype = weights.get("num_bits"), weights.get("type", "int")
    strategy = weights.get("strategy")
    if weights.get("dynamic"):
        raise ValueError(f"{where}.weights: dynamic weight quantization is not supported")
    if wtype == "float":
        if bits != 8:
            raise ValueError(f"{where}.weights: float weights with num_bits={bits} are not supported (FP8 only)")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"{where}.weights.strategy {strategy!r} is not supported for FP8")
        block = tuple(weights.get("block_structure") or ()) if strategy == "block" else None
        if acts is None:
            act, act_group = "none", 0
        elif acts.get("type", "float") != "float" or acts.get("num_bits") != 8:
            raise ValueError(f"{where}.input_activations: only FP8 activations go with FP8 weights")
        elif not acts.get("dynamic"):
            act, act_group = "static", 0
        elif acts.get("strategy") == "token":
            act, act_group = "token", 0
        elif acts.get("strategy") == "group":
            act, act_group = "group", int(acts.get("group_size") or 128)
        else:
            raise ValueError(f"{where}.input_activations.strategy {acts.get('strategy')!r} is not supported")
        if act == "none":
            raise ValueError(f"{where}: FP8 weights without activation quantization (W8A16 FP8) are not supported")
        return CTFP8(strategy, block, act, act_group)
    if wtype != "int":
        raise ValueError(f"{where}.weights.type {wtype!r} is not supported (int or float)")
    if acts is not None:
        if not (bits == 8 and acts.get("num_bits") == 8 and acts.get("type", "int") == "int"):
            raise ValueError(
                f"{where}: int weights with {acts.get('num_bits')}-bit activations are not supported "
                "(W8A8 INT8 or weight-only)"
            )
        if not acts.get("dynamic") or acts.get("strategy") != "token" or not acts.get("symmetric", True):
            raise ValueError(f"{where}.input_activations: only dynamic symmetric per-token INT8 is supported")
        if not weights.get("symmetric", True) or strategy not in ("channel", "tensor"):
            raise ValueError(f"{where}.weights: W8A8 INT8 needs symmetric per-channel or per-tensor weights")
        return CTInt8(per_tensor=strategy == "tensor")
    if strategy not in ("group", "channel"):
        raise ValueError(f"{where}.weights.strategy {strategy!r} is not supported for weight-only quantization")
    if fmt not in ("pack-quantized", "naive-quantized", "int-quantized"):
        raise ValueError(f"{where}.format {fmt!r} is not supported for weight-only int weights")
    if fmt != "pack-quantized" and bits != 8:
        raise ValueError(f"{where}: {bits}-bit weights must be pack-quantized")
    group_size = weights.get("group_size") if strategy == "group" else None
    # actorder "group" stores a weight_g_idx; "weight" (act order with static groups) stores the weight as usual
    return CTWNA16(
        bits,
        group_size,
        weights.get("symmetric", True),
        weights.get("actorder") == "group" and strategy == "group",
        fmt == "pack-quantized",
    )


class CompressedTensorsConfig(QuantizationConfig):
    """A compressed-tensors `quantization_config`: config groups (targets -> scheme) and the ignore list."""

    method = METHOD
    quantized_suffixes = (".weight_packed", ".weight_scale")

    def __init__(self, cfg: dict) -> None:
        groups = cfg.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError(f"{METHOD} quantization_config has no config_groups")
        if cfg.get("sparsity_config"):
            raise ValueError(f"{METHOD} sparsity_config (sparse checkpoints) is not supported")
        if cfg.get("transform_config"):
            raise ValueError(f"{METHOD} transform_config (rotated checkpoints) is not supported")
        self.groups = [(g.get("targets") or [], _scheme_of_group(n, g, cfg.get("format"))) for n, g in groups.items()]
        self.ignore = list(cfg.get("ignore") or [])
        self.kv_cache_scheme = cfg.get("kv_cache_scheme")

    def scheme_for(self, hf_module_name: str) -> LinearScheme | None:
        if any(_matches(i, hf_module_name) for i in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(t, hf_module_name) for t in targets):
                return scheme
        return None

    def describe(self) -> str:
        return ", ".join(sorted({s.describe() for _, s in self.groups}))
