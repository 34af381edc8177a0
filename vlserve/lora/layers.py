"""LoRA-capable versions of the decoder's linear layers, and the per-step context they read.

`LoRAModelManager` turns the decoder's `qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj` (and each dense
`GatedMLP`) into these classes in place (`wrap_layer`: the class changes, the module and its parameters stay, as
`kernels.packed_linear.packable` does), so checkpoint names, CPU weight packing, quantization schemes and tensor
parallel loading see the layer they had. Each LoRA layer holds, per output slice `s` (q/k/v of qkv_proj, gate/up
of gate_up_proj, the whole output of o_proj/down_proj):

- `lora_a[s] [max_loras, max_rank, in_local]` and `lora_b[s] [max_loras, out_s, max_rank]` (ranks zero-padded,
  PEFT's scaling folded into B), written by the manager into device slots;
- `lora_ranks[slot][s]`: the rank slot `slot` has there (0: no weights).

`forward(x)` = the base layer's output (through the packed kernel or quantization scheme, as before), then for
each `(slot, rows)` group of the step (`lora_step`) the delta `x[rows] @ A^T @ B^T` added in place on those rows
(`punica_ref.add_lora_grouped`). Tokens with slot -1 keep exactly the base output; with no active step, or no
slot of the step holding weights for this layer, nothing is added at all.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlserve.distributed.communication import tp_all_reduce
from vlserve.kernels.cpu_linear import PANEL, cpu_linear_silu_mul
from vlserve.kernels.packed_linear import PackableLinear
from vlserve.lora.punica_ref import add_lora_grouped, take_rows, token_groups
from vlserve.models.layers import GatedMLP
from vlserve.models.parallel_layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear


@dataclass(frozen=True)
class LoRAStep:
    """What every LoRA layer reads during one forward: `token_slots [T]` int64 (-1: no adapter) and its groups
    `((slot, rows), ...)` (see `punica_ref.token_groups`), computed once per step. An encoder run has one adapter
    for all its rows, whatever their count: `token_slots` None and one group `(slot, slice(None))`."""

    token_slots: torch.Tensor | None
    groups: tuple


_current: list[LoRAStep] = []  # a stack, as kernels.attention_op's steps


@contextlib.contextmanager
def lora_step(token_slots: torch.Tensor):
    """Make `token_slots [T]` (int64, one device slot per token, -1 = base) what the LoRA layers apply during the
    block (mirrors `kernels.attention_op.attention_step`)."""
    _current.append(LoRAStep(token_slots, token_groups(token_slots)))
    try:
        yield _current[-1]
    finally:
        _current.pop()


@contextlib.contextmanager
def uniform_lora_step(slot: int):
    """Make `slot` the adapter of every row the LoRA layers see during the block (an encoder run: the tower's
    items all belong to requests of one adapter)."""
    _current.append(LoRAStep(None, ((slot, slice(None)),)))
    try:
        yield _current[-1]
    finally:
        _current.pop()


def current_lora_step() -> LoRAStep | None:
    """The innermost active step, or None outside `lora_step` (the layers then run as their base)."""
    return _current[-1] if _current else None


class LoRALayerMixin:
    """The slot storage and the delta of a LoRA-capable linear (mixed in before the base layer class)."""

    base_class: type
    lora_pieces: tuple[str, ...]  # HF projection of each output slice, in output order

    def init_lora(self, max_loras: int, max_rank: int, pieces: tuple[str, ...], dtype: torch.dtype,
                  device: torch.device) -> None:
        """Allocate zeroed slot storage for `pieces` (the HF projections filling this layer's output)."""
        self.lora_pieces, self.max_loras, self.max_lora_rank = tuple(pieces), max_loras, max_rank
        self.lora_offsets = [self.lora_slice_rows(p)[0] for p in pieces]
        self.lora_a = [torch.zeros(max_loras, max_rank, self.in_features, dtype=dtype, device=device)
                       for _ in pieces]  # each [L, R, in_local]
        self.lora_b = [torch.zeros(max_loras, self.lora_slice_rows(p)[1], max_rank, dtype=dtype, device=device)
                       for p in pieces]  # each [L, out_s, R]
        self.lora_ranks = [[0] * len(pieces) for _ in range(max_loras)]

    # -- the shapes the checkpoint reader checks against (vlserve.lora.peft_checkpoint) ----------------------------
    def lora_slice_rows(self, piece: str) -> tuple[int, int]:
        """`(offset, count)` of `piece`'s rows in this rank's output."""
        return self.local_rows(piece) if hasattr(self, "piece_offsets") else (0, self.out_features)

    def checkpoint_out_rows(self, piece: str) -> tuple[int, int, int | None]:
        """`(start, count, total)` of the rows of `piece`'s lora_B this rank reads; total = the checkpoint's row
        count (None where it is not known here: replicated KV heads under tensor parallelism)."""
        start, count = self.checkpoint_rows(piece)
        total = count * self.tp_size
        if self.tp_size > 1 and piece in ("k_proj", "v_proj"):
            total = None
        return start, count, total

    def checkpoint_in_cols(self) -> tuple[int, int, int]:
        """`(start, count, total)` of the columns of lora_A this rank reads (all of them: the input is whole)."""
        return 0, self.in_features, self.in_features

    # -- slots ------------------------------------------------------------------------------------------------
    def set_lora(self, slot: int, weights: dict) -> None:
        """Write an adapter's `{piece: LoRAWeights}` for this layer into `slot` (pieces absent: zero)."""
        self.reset_lora(slot)
        for i, piece in enumerate(self.lora_pieces):
            w = weights.get(piece)
            if w is None:
                continue
            r = w.rank
            self.lora_a[i][slot, :r].copy_(w.lora_a)  # [r, in_local]
            self.lora_b[i][slot, :, :r].copy_(w.lora_b)  # [out_s, r]
            self.lora_ranks[slot][i] = r

    def reset_lora(self, slot: int) -> None:
        """Empty `slot`."""
        for a, b in zip(self.lora_a, self.lora_b):
            a[slot].zero_()
            b[slot].zero_()
        self.lora_ranks[slot] = [0] * len(self.lora_pieces)

    def lora_groups(self, step: LoRAStep | None) -> tuple:
        """The step's `(slot, rows)` groups whose slot holds weights for this layer."""
        if step is None:
            return ()
        return tuple(g for g in step.groups if any(self.lora_ranks[g[0]]))

    def add_lora(self, x: torch.Tensor, out: torch.Tensor, groups) -> torch.Tensor:
        """`out [T, O] += delta` on the groups' rows (in place; `x [T, I]`); returns out."""
        if groups:
            add_lora_grouped(x, out, self.lora_a, self.lora_b, self.lora_offsets, self.lora_ranks, groups)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, I] -> base [T, O] (+ delta on the step's adapter rows)
        out = super().forward(x)
        groups = self.lora_groups(current_lora_step())
        return self.add_lora(x, out, groups) if groups else out


class QKVParallelLinearWithLoRA(LoRALayerMixin, QKVParallelLinear):
    """qkv_proj with LoRA slices q_proj, k_proj, v_proj."""

    base_class = QKVParallelLinear


class MergedColumnParallelLinearWithLoRA(LoRALayerMixin, MergedColumnParallelLinear):
    """gate_up_proj with LoRA slices gate_proj, up_proj."""

    base_class = MergedColumnParallelLinear


class RowParallelLinearWithLoRA(LoRALayerMixin, RowParallelLinear):
    """o_proj / down_proj with LoRA: A split on its input dim like the weight; under tensor parallelism the delta
    is added to this rank's partial product before the sum (the delta is linear in A's split input)."""

    base_class = RowParallelLinear

    def checkpoint_out_rows(self, piece: str) -> tuple[int, int, int | None]:
        return 0, self.out_features, self.out_features

    def checkpoint_in_cols(self) -> tuple[int, int, int]:
        return self.tp_rank * self.in_features, self.in_features, self.in_features * self.tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, I/tp] -> partial [T, O] (+ delta) -> summed over ranks (+ bias)
        groups = self.lora_groups(current_lora_step())
        if self.tp_size == 1:
            out = self.matmul(x, self.bias)
            return self.add_lora(x, out, groups) if groups else out
        out = tp_all_reduce(self.add_lora(x, self.matmul(x, None), groups))
        return out if self.bias is None else out + self.bias


class GatedMLPWithLoRA(GatedMLP):
    """GatedMLP whose packed fused `silu(gate) * up` path stays for rows without a gate_up adapter: it runs on the
    whole step (base rows bit-identical), then adapter rows are recomputed unfused with their delta."""

    base_class = GatedMLP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> act [T, I] -> [T, H]
        proj = self.gate_up_proj
        groups = proj.lora_groups(current_lora_step()) if isinstance(proj, LoRALayerMixin) else ()
        fusable = self.hidden_act in ("silu", "swish") and self.intermediate_size % PANEL == 0
        if not groups or proj.packed_weight is None or not fusable:
            return super().forward(x)  # gate_up_proj adds its own delta on the unfused path
        act = cpu_linear_silu_mul(x, proj.packed_weight, proj.bias, self.intermediate_size)  # [T, I]
        for slot, rows in groups:
            xs = take_rows(x, rows)  # [n, H]
            gate_up = proj.add_lora(xs, proj.matmul(xs, proj.bias), ((slot, slice(0, xs.shape[0])),))  # [n, 2I]
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            rows_act = F.silu(gate) * up  # [n, I]
            if isinstance(rows, slice):
                act[rows] = rows_act
            else:
                act.index_copy_(0, rows, rows_act)
        return self.down_proj(act)


class LinearWithLoRA(LoRALayerMixin, PackableLinear):
    """A vision / audio tower's or a projector's linear with LoRA: one output slice (the whole output), inputs of
    any leading shape (`[..., I]`), never sharded (the encoder parts are replicated under tensor parallelism)."""

    base_class = PackableLinear

    def checkpoint_out_rows(self, piece: str) -> tuple[int, int, int | None]:
        return 0, self.out_features, self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., I] -> [..., O] (+ delta on the step's adapter rows)
        out = self.matmul(x, self.bias)
        groups = self.lora_groups(current_lora_step())
        if groups:
            self.add_lora(x.reshape(-1, self.in_features), out.view(-1, self.out_features), groups)  # [R, I] -> [R, O]
        return out


_LORA_CLASSES = {QKVParallelLinear: QKVParallelLinearWithLoRA,
                 MergedColumnParallelLinear: MergedColumnParallelLinearWithLoRA,
                 RowParallelLinear: RowParallelLinearWithLoRA,
                 PackableLinear: LinearWithLoRA}


def wrap_layer(module: torch.nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
               pieces: tuple[str, ...] | None = None):
    """Turn a decoder linear into its LoRA class in place (same module, same parameters) with zeroed slots;
    `pieces` names its output slices (default: a fused layer's pieces; an encoder linear needs them given).
    ValueError for other layer types."""
    cls = _LORA_CLASSES.get(type(module))
    if cls is None:
        raise ValueError(f"LoRA is not supported on {type(module).__name__}")
    module.__class__ = cls
    module.init_lora(max_loras, max_rank, tuple(pieces or module.piece_offsets), dtype, device)
    return module


def wrap_mlp(mlp: torch.nn.Module) -> torch.nn.Module:
    """Turn a dense GatedMLP into GatedMLPWithLoRA in place (its linears are wrapped separately)."""
    if type(mlp) is not GatedMLP:
        raise ValueError(f"LoRA is not supported on {type(mlp).__name__}")
    mlp.__class__ = GatedMLPWithLoRA
    return mlp


def unwrap(module: torch.nn.Module) -> None:
    """Back to the base class, slot storage dropped."""
    base = getattr(type(module), "base_class", None)
    if base is None:
        return
    for attr in ("lora_a", "lora_b", "lora_ranks", "lora_pieces", "lora_offsets", "max_loras", "max_lora_rank"):
        module.__dict__.pop(attr, None)
    module.__class__ = base
