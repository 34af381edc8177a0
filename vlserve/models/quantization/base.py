"""The quantization seam: a config read from the checkpoint picks a `LinearScheme` for each linear layer; the scheme
replaces the layer's `weight` with the checkpoint's quantized tensors, turns them into a kernel's form once loaded,
and runs the layer's matmul.

A linear layer (`kernels.packed_linear.PackableLinear` and the tensor-parallel layers built on it) knows nothing of
formats: it calls `layer.quant_scheme.apply(layer, x, bias)` when a scheme is set, and loads or shards a parameter
by the layout tags the scheme records for each of its parameters (`layer.quant_layouts`, `QuantParamLayout`): which dim runs along the layer's output
and input, and how many output or input units one element there covers (a packed int32 word holds 8 4-bit values;
a group scale covers `group_size` input columns).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class QuantParamLayout:
    """How a quantized parameter lies against its layer's `[out, in]` matrix: `output_dim` / `input_dim` (None: the
    tensor does not run along it), and the units of the matrix one element covers along each (`output_div`,
    `input_div`). `per_piece_scalar`: one value per fused piece in the checkpoint (a per-tensor scale), broadcast
    over that piece's rows. `same_in_pieces`: every fused piece carries the same tensor (GPTQ's g_idx).
    `expand_rows`: the checkpoint holds one row per block of this many output rows (FP8 block scales, the last
    block of a piece possibly partial); the parameter holds one row per output row, so fused pieces and
    tensor-parallel splits need not fall on block boundaries."""

    output_dim: int | None = 0
    input_dim: int | None = 1
    output_div: int = 1
    input_div: int = 1
    per_piece_scalar: bool = False
    same_in_pieces: bool = False
    expand_rows: int = 1


PLAIN_WEIGHT = QuantParamLayout()
PLAIN_BIAS = QuantParamLayout(output_dim=0, input_dim=None)


def layout_of(layer: nn.Module, param_name: str) -> QuantParamLayout:
    """The layout of one of a linear layer's parameters (a plain weight or bias unless a scheme tagged it)."""
    tag = getattr(layer, "quant_layouts", {}).get(param_name)
    if tag is not None:
        return tag
    return PLAIN_BIAS if param_name == "bias" else PLAIN_WEIGHT


def add_quant_param(
    layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, layout: QuantParamLayout
) -> None:
    """Register an empty, frozen parameter `name` on `layer` (on `layer.quant_device`, meta while building) and
    record its layout in `layer.quant_layouts`."""
    device = getattr(layer, "quant_device", None) or torch.get_default_device()
    layer.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False))
    if "quant_layouts" not in layer.__dict__:
        layer.quant_layouts = {}
    layer.quant_layouts[name] = layout


def check_divides(what: str, size: int, div: int, method: str) -> None:
    """ValueError unless `div` divides `size` (a group size or a packing factor against a layer dimension)."""
    if size % div:
        raise ValueError(f"{method}: {what} {size} is not divisible by {div}")


class LinearScheme(ABC):
    """How one quantized format stores and multiplies one linear layer."""

    method: str = ""
    quantizes_activations = False  # whether activations are rounded to the format's grid before the matmul

    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Replace `layer.weight` with this format's parameters, sized for the layer's (local) `out_features` x
        `in_features` and tagged with their layouts."""

    @abstractmethod
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded checkpoint tensors into the kernel's form (`layer.quant_weights`) and drop them."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> [..., out]: the layer's matmul through this scheme's kernel."""

    def apply_silu_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, intermediate: int
    ) -> torch.Tensor | None:
        """For a gate_up layer: silu(gate) * up [..., intermediate] in one pass of this scheme's kernel, or None
        where it has no fused form here (the default)."""
        return None

    def describe(self) -> str:
        """A short name for logs and errors."""
        return self.method


class QuantizationConfig(ABC):
    """A checkpoint's `quantization_config`, parsed: picks the scheme of each quantized linear layer."""

    method: str = ""
    quantized_suffixes: tuple[str, ...] = ()  # tensor-name suffixes that mark a module stored quantized

    @abstractmethod
    def scheme_for(self, hf_module_name: str) -> LinearScheme | None:
        """The scheme of the checkpoint module `hf_module_name` (e.g. `model.layers.0.self_attn.q_proj`), or None
        when the config leaves it unquantized (its ignore list)."""

    def describe(self) -> str:
        """A short name for logs."""
        return self.method


def shard_range(start: int, count: int, div: int, what: str) -> tuple[int, int]:
    """`(start, count)` in matrix units -> in elements of a tensor whose element covers `div` units; ValueError
    when the range does not fall on element boundaries (a packed or grouped tensor that cannot be split there)."""
    if start % div or count % div:
        raise ValueError(
            f"{what}: rows/columns [{start}, {start + count}) do not fall on its packing or group "
            f"boundaries ({div} per element), so it cannot be split over the tensor-parallel ranks"
        )
    return start // div, count // div


def copy_into_rows(
    layer: nn.Module,
    param_name: str,
    offset: int | None,
    count: int | None,
    tensor: torch.Tensor,
    name: str,
    source_start: int = 0,
) -> None:
    """Copy checkpoint tensor `name` into `param`: into output units `[offset, offset + count)` along the layout's
    output dim (a fused piece), or the whole parameter when `offset` is None or the tensor has no output dim.
    A per-piece scalar is broadcast over its rows; a `same_in_pieces` tensor already loaded must be equal; an
    `expand_rows` tensor (read whole) is expanded to rows, and rows from `source_start` on are taken."""
    layout = layout_of(layer, param_name)
    dst = getattr(layer, param_name).data
    if offset is not None and layout.output_dim is not None:
        first, length = shard_range(offset, count, layout.output_div, name)
        dst = dst.narrow(layout.output_dim, first, length)
    if layout.expand_rows > 1:
        rows = tensor.repeat_interleave(layout.expand_rows, dim=layout.output_dim)
        tensor = rows.narrow(
            layout.output_dim,
            source_start,
            min(dst.shape[layout.output_dim], rows.shape[layout.output_dim] - source_start),
        )
    if layout.per_piece_scalar and tensor.numel() == 1:
        dst.fill_(tensor.reshape(()).item())
        return
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    loaded = layer.__dict__.setdefault("quant_loaded", set())
    if layout.same_in_pieces and param_name in loaded:
        if not torch.equal(dst, tensor.to(dst.dtype)):
            raise ValueError(f"weight {name!r} differs from the one of the other projections fused with it")
        return
    dst.copy_(tensor)
    if layout.same_in_pieces:
        loaded.add(param_name)
