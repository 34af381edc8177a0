"""Linear layers whose weight the runner may pack for the CPU kernel (`kernels.cpu_linear`) once loaded.

`PackableLinear` is an `nn.Linear` (same parameter names and shapes, so checkpoints load unchanged) that, after
`pack_for_cpu()`, holds its matrix only as `packed_weight` and multiplies through the packed kernel. The decoder's
parallel layers (`models.parallel_layers`) and the encoders' towers, projectors and mergers are built from it, and
`pack_linears_for_cpu(model)` packs every one of them (and every other module with a `pack_for_cpu` method, such as
the towers' patch embeddings) in one walk. `packable(module)` turns the plain `nn.Linear`s of a module built by
someone else (timm) into PackableLinears in place.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vlserve.kernels.cpu_linear import (
    cpu_linear,
    cpu_linear_silu,
    cpu_linear_silu_mul,
    cpu_linear_supported,
    onednn_min_rows,
    onednn_takes,
    pack_linear_weight,
    torch_serves_many_rows,
)
from vlserve.kernels.onednn_linear import onednn_linear, prepack_onednn

logger = logging.getLogger(__name__)


def _pack_matrix(module: nn.Module, matrix: torch.Tensor, keep_weight: bool) -> bool:
    """Give `module` a `packed_weight` of `matrix` [N, K] if the kernel serves it here (dropping `weight` unless
    `keep_weight`, or unless torch's matmul beats the kernel from some row count on: then both are held and
    `onednn_rows` says from where); whether it did."""
    if module.packed_weight is not None or not cpu_linear_supported(matrix):
        return False
    module.packed_weight = nn.Parameter(pack_linear_weight(matrix), requires_grad=False)
    module.onednn_rows = onednn_min_rows(matrix.dtype)
    if module.onednn_rows is not None and not keep_weight:
        _prepack_onednn(module, matrix)
    if not keep_weight and (module.onednn_rows is None or module.onednn_weight is not None):
        module.weight = None  # held once more at most; a stray F.linear now fails loudly
    return True


def _prepack_onednn(module: nn.Module, matrix: torch.Tensor) -> bool:
    """Give `module` oneDNN's prepacked form of `matrix` [N, K] where it serves this dtype here (`onednn_linear`);
    whether it did. The caller drops `weight` then."""
    module.onednn_weight = prepack_onednn(matrix)
    return module.onednn_weight is not None


def _prepack_only(module: nn.Module, matrix) -> bool:
    """`prepack_for_onednn` of an unpacked module: `matrix()` [N, K] prepacked, `weight` dropped; whether it was."""
    if module.packed_weight is not None or module.weight is None or not _prepack_onednn(module, matrix()):
        return False
    module.weight = None
    return True


def _unpacked_matmul(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) by torch: on oneDNN's prepacked matrix where the module holds one, else F.linear on
    the plain weight seen as [N, K] (a linear's as is, a patch convolution's flattened)."""
    if module.onednn_weight is not None:
        return onednn_linear(x, module.onednn_weight, bias, out_features)
    return F.linear(x, module.weight.reshape(out_features, -1), bias)


def _packed_for(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The packed matrix to multiply `x [..., I]` by, or None for torch's matmul on `weight` (not packed, or
    packed too but `x` has at least `onednn_rows` rows)."""
    if module.packed_weight is None or onednn_takes(x, module.onednn_rows):
        return None
    return module.packed_weight


class PackableLinear(nn.Linear):
    """An nn.Linear whose weight the runner may pack for the CPU kernel once loaded: `pack_for_cpu()` swaps
    `weight` [O, I] for `packed_weight` (float32 [O/32, I, 32], bf16 [O/32, I/2, 32, 2]; the matrix is then held
    once)."""

    onednn_weight: torch.Tensor | None = None  # (class default for instances made by swapping __class__)

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_parameter("packed_weight", None)
        self.onednn_rows: int | None = None  # packed, and from this many rows on torch's matmul on `weight`
        self.onednn_weight: torch.Tensor | None = None  # oneDNN's prepacked matrix, held instead of `weight`
        self.quant_scheme = None  # set by models.quantization: the matmul then runs through the scheme

    def pack_for_cpu(self, keep_weight: bool = False) -> bool:
        """Pack the weight if the kernel serves it here; whether it did. `keep_weight`: another module shares the
        matrix (a tied LM head), so it stays and the packed one is a copy."""
        return _pack_matrix(self, self.weight.data, keep_weight)

    def prepack_for_onednn(self) -> bool:
        """Hold the matrix only in oneDNN's prepacked form where that serves its dtype here (a tower's linears on
        AMX, fed hundreds of rows a call); whether it did."""
        return _prepack_only(self, lambda: self.weight.data)

    def packed_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The packed matrix the kernel multiplies `x [..., I]` by, or None when torch's matmul on `weight` runs."""
        return _packed_for(self, x)

    def silu_mul(self, x: torch.Tensor, intermediate: int) -> torch.Tensor | None:
        """For a gate_up projection ([2I, H], gate rows first): silu(gate) * up [..., I] in one kernel pass (the
        packed kernel's, or the quantization scheme's), rounded as the unfused ops round; None where no kernel here
        fuses it for `x` (the caller then runs the projection and the activation apart)."""
        if self.quant_scheme is not None:
            return self.quant_scheme.apply_silu_mul(self, x, self.bias, intermediate)
        packed = _packed_for(self, x)
        return None if packed is None else cpu_linear_silu_mul(x, packed, self.bias, intermediate)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., I] @ W^T (+ bias) -> [..., O], through the packed kernel once packed, through the quantization
        scheme's kernel when the layer is quantized."""
        if self.quant_scheme is not None:
            return self.quant_scheme.apply(self, x, bias)
        packed = _packed_for(self, x)
        if packed is not None:
            return cpu_linear(x, packed, bias, self.out_features)
        return _unpacked_matmul(self, x, bias, self.out_features)

    def matmul_silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x @ W^T + b) -> [..., O]: in the packed kernel's epilogue where it takes `x` (rounded as the matmul
        then silu round), inside oneDNN's matmul (each float32 sum activated, then rounded once) where the matrix is
        held prepacked for it, else the matmul then silu in place."""
        if self.quant_scheme is None:
            packed = _packed_for(self, x)
            if packed is not None:
                return cpu_linear_silu(x, packed, self.bias, self.out_features)
            if self.onednn_weight is not None:
                return onednn_linear(x, self.onednn_weight, self.bias, self.out_features, post_op="swish")
        return F.silu(self.matmul(x, self.bias), inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


def packable(module: nn.Module) -> nn.Module:
    """Turn every plain `nn.Linear` under `module` (itself included) into a PackableLinear in place, keeping its
    parameters; returns `module`. For modules another library builds (timm towers): their code may read a
    linear's `.weight` directly (timm's EVA attention does, with a separate q/v bias), so these keep the matrix
    beside the packed copy."""
    for sub in module.modules():
        if type(sub) is nn.Linear:
            sub.__class__ = PackableLinear
            sub.register_parameter("packed_weight", None)
            sub.quant_scheme = None
            sub.onednn_rows = None
            sub.onednn_weight = None
            sub.keep_weight = True
    return module


def row_breaks(model: nn.Module) -> list[int]:
    """The row counts above 2 from which some linear of `model` hands its rows to oneDNN (`onednn_rows`): a
    compiled forward guards on each, so every range between two is a shape class that compiles of its own."""
    return sorted({r for m in model.modules() if (r := getattr(m, "onednn_rows", None)) is not None and r > 2})


def pack_linears_for_cpu(model: nn.Module, many_rows: Iterable[nn.Module] = ()) -> int:
    """Pack every module of `model` with a `pack_for_cpu` method (PackableLinears, patch embeddings) that the CPU
    linear kernel serves; how many were packed. A weight that another module holds too (tying) stays where it is
    beside its packed copy. Under the `many_rows` parts (towers: hundreds of patches a call), a weight whose dtype
    torch's matmul serves faster at many rows (`torch_serves_many_rows`: float32 on Intel CPUs, and bf16 on AMX) is
    left unpacked (and held in oneDNN's prepacked form instead where that serves it: bf16 on AMX)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders[id(param)] = holders.get(id(param), 0) + 1
    unpacked = {
        id(m)
        for part in many_rows
        for m in part.modules()
        if getattr(m, "weight", None) is not None and torch_serves_many_rows(m.weight.dtype)
    }
    packed = 0
    for m in model.modules():
        pack = getattr(m, "pack_for_cpu", None)
        if id(m) in unpacked:
            shared = holders.get(id(m.weight), 0) > 1 or getattr(m, "keep_weight", False)
            if hasattr(m, "prepack_for_onednn") and not shared:
                m.prepack_for_onednn()
            continue
        # modules without a `weight` (stacked MoE experts) decide for themselves whether they are packed already
        if pack is not None and (getattr(m, "weight", None) is not None or not hasattr(m, "weight")):
            shared = hasattr(m, "weight") and holders.get(id(m.weight), 0) > 1
            packed += pack(keep_weight=shared or getattr(m, "keep_weight", False))
    split = [m for m in model.modules() if getattr(m, "onednn_rows", None) and m.packed_weight is not None]
    if split:
        twice = sum(m.packed_weight.numel() * m.packed_weight.element_size() for m in split)
        logger.info(
            "%d packed CPU linears hand inputs of %d+ rows to torch's matmul (oneDNN): their matrices are "
            "held twice, %.2f GiB more",
            len(split),
            split[0].onednn_rows,
            twice / 2**30,
        )
    return packed


class _PatchConv:
    """A convolution whose kernel equals its stride over pre-cut patches is one matmul with the flattened weight
    `[E, C*k...]`: `rows(x [..., C*k...]) -> [..., E]`, through the packed kernel once `pack_for_cpu()` ran. The
    parameter keeps the checkpoint's conv shape (`weight [E, C, k...]`) so weights load by name."""

    packed_weight: nn.Parameter | None
    onednn_rows: int | None = None
    onednn_weight: torch.Tensor | None = None

    def pack_for_cpu(self, keep_weight: bool = False) -> bool:
        """Pack the flattened weight if the kernel serves it here; whether it did."""
        if self.packed_weight is not None:
            return False
        return _pack_matrix(self, self.weight.data.reshape(self.out_channels, -1), keep_weight)  # [E, C*k...]

    def prepack_for_onednn(self) -> bool:
        """Hold the flattened matrix only in oneDNN's prepacked form where that serves its dtype here; whether it
        did."""
        return _prepack_only(self, lambda: self.weight.data.reshape(self.out_channels, -1))

    @property
    def param(self) -> torch.Tensor:
        """The matrix as held now (packed or not): for the dtype and device inputs are cast to."""
        if self.packed_weight is not None:
            return self.packed_weight
        return self.weight if self.weight is not None else self.onednn_weight

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """Patch rows `[..., C*k...]` (in the weight's flattening order) -> `[..., E]`."""
        x = x.to(self.param.dtype)
        packed = _packed_for(self, x)
        if packed is not None:
            return cpu_linear(x, packed, self.bias, self.out_channels)
        return _unpacked_matmul(self, x, self.bias, self.out_channels)


class PatchConv2d(_PatchConv, nn.Conv2d):
    """`nn.Conv2d(C, E, p, stride=p)` over whole images, run as one GEMM: `[N, C, S, S]` -> `[N, (S/p)**2, E]`."""

    def __init__(self, in_channels: int, out_channels: int, patch_size: int, bias: bool = True) -> None:
        super().__init__(in_channels, out_channels, patch_size, stride=patch_size, bias=bias)
        self.register_parameter("packed_weight", None)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        n, c, height, width = pixels.shape
        p = self.kernel_size[0]
        gh, gw = height // p, width // p
        cut = pixels[:, :, : gh * p, : gw * p].reshape(n, c, gh, p, gw, p)
        patches = cut.permute(0, 2, 4, 1, 3, 5).reshape(n, gh * gw, c * p * p)  # [N, np, C*p*p], row-major grid
        return self.rows(patches)  # [N, np, E]


class PatchConv3d(_PatchConv, nn.Conv3d):
    """`nn.Conv3d(C, E, (tp, p, p), stride=(tp, p, p))` over pre-cut patch rows `[P, C*tp*p*p]` -> `[P, E]` (the
    Qwen-VL processors emit patches already cut and flattened in the weight's order)."""

    def __init__(self, in_channels: int, out_channels: int, kernel: tuple[int, int, int], bias: bool = False) -> None:
        super().__init__(in_channels, out_channels, kernel_size=kernel, stride=kernel, bias=bias)
        self.register_parameter("packed_weight", None)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.rows(rows)


class PackableConv1d(_PatchConv, nn.Conv1d):
    """`nn.Conv1d` (zero padding, no dilation or groups) run as im2col + one GEMM on the flattened kernel, so it
    packs like a linear: `[B, C, T]` -> `[B, E, T_out]` (torch's bf16 convolution on CPUs without native bf16 math
    cost a Whisper stem seconds)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        padding: int = 0,
        bias: bool = True,
    ) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=bias)
        self.register_parameter("packed_weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is None and self.onednn_weight is None:
            return super().forward(x.to(self.weight.dtype))
        (k,), (s,), (p,) = self.kernel_size, self.stride, self.padding
        cols = F.pad(x, (p, p)).unfold(2, k, s)  # [B, C, T_out, k]
        rows = cols.permute(0, 2, 1, 3).reshape(x.shape[0], cols.shape[2], -1)  # [B, T_out, C*k], the weight's order
        return self.rows(rows).transpose(1, 2)  # [B, E, T_out]
