"""LoRA-capable versions of the decoder's linear layers, and the per-step context they read.

`LoRAModelManager` turns the decoder's `qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj` (and each dense
`GatedMLP`) into these classes in place (`wrap_layer`: the class changes, the module and its parameters stay, as
`kernels.packed_linear.packable` does), so checkpoint names, CPU weight packing, quantization schemes and tensor
parallel loading see the layer they had. Each LoRA layer holds, per output slice `s` (q/k/v of qkv_proj, gate/up
of gate_up_proj, the whole output of o_proj/down_proj):

- `lora_a[s] [max_loras, max_rank, in_local]` and `lora_b[s] [max_loras, out_s, max_rank]` (ranks zero-padded,
  PEFT's scaling folded into B), written by the manager into device slots;
- `lora_ranks[slot][s]`: the rank slot `slot` has there (0: no weights).

The slots live in one `kernels.lora_cpu.LoRAStack` per layer (`a [L, S*R, I]`, `b [L, R, O]`, ranks); `lora_a`
and `lora_b` are views into it, so every path reads the same copy.

`forward(x)` = the base layer's output (through the packed kernel or quantization scheme, as before), then the
delta `x[t] @ A[slot_t]^T @ B[slot_t]^T` added in place on the rows of tokens with a slot (`lora_step`): on CPU in
one C++ call per layer (`kernels.lora_cpu`), on CUDA through the Triton shrink / expand (`kernels.triton_lora`, no
host sync), else (and for an encoder run's single slot) grouped by slot in torch (`kernels.lora_ref`). Tokens with
slot -1 keep exactly the base output; with no active step, or no slot of the step holding weights for this layer,
nothing is added at all.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vlserve.distributed.communication import tp_all_reduce
from vlserve.kernels.cpu_linear import PANEL, cpu_linear_silu_mul
from vlserve.kernels.lora_cpu import LoRAStack, lora_add_cpu, lora_cpu_supported
from vlserve.kernels.lora_ref import add_lora_grouped, take_rows, token_groups
from vlserve.kernels.packed_linear import PackableLinear
from vlserve.models.layers import GatedMLP
from vlserve.models.parallel_layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear


@dataclass
class LoRAStep:
    """What every LoRA layer reads during one forward: `token_slots [T]` int64 on the model's device (-1: no
    adapter) and the distinct slots it uses (known on the host, so layers never read the slots back). An encoder
    run has one adapter for all its rows, whatever their count: `token_slots` None and `uniform_slot` set."""

    token_slots: torch.Tensor | None
    active_slots: tuple[int, ...]
    uniform_slot: int | None = None
    captured: bool = False  # a CUDA graph's step: every layer adds its delta, whatever the slots hold now
    _groups: tuple | None = None
    triton_blocks: dict = field(default_factory=dict)  # (max_loras, BLOCK_M) -> the step's Triton token blocks

    @property
    def groups(self) -> tuple:
        """`((slot, rows), ...)` for the torch twin (`lora_ref.token_groups`; made once a step, on first use)."""
        if self._groups is None:
            self._groups = (
                ((self.uniform_slot, slice(None)),) if self.token_slots is None else token_groups(self.token_slots)
            )
        return self._groups


_current: list[LoRAStep] = []  # a stack, as kernels.attention_op's steps


@contextlib.contextmanager
def lora_step(token_slots: torch.Tensor, active_slots: tuple[int, ...] | None = None):
    """Make `token_slots [T]` (int64, one device slot per token, -1 = base) what the LoRA layers apply during the
    block (mirrors `kernels.attention_op.attention_step`); `active_slots`: its distinct slots >= 0 (read from the
    tensor when not given)."""
    if active_slots is None:
        active_slots = tuple(sorted(set(token_slots.tolist()) - {-1}))
    _current.append(LoRAStep(token_slots, tuple(active_slots)))
    try:
        yield _current[-1]
    finally:
        _current.pop()


@contextlib.contextmanager
def uniform_lora_step(slot: int):
    """Make `slot` the adapter of every row the LoRA layers see during the block (an encoder run: the tower's
    items all belong to requests of one adapter)."""
    _current.append(LoRAStep(None, (slot,), uniform_slot=slot))
    try:
        yield _current[-1]
    finally:
        _current.pop()


@contextlib.contextmanager
def captured_lora_step(slot_buffer: torch.Tensor):
    """The step a CUDA graph is captured (or its replay emulated) under: slots read from `slot_buffer [T]` (a
    persistent graph input), and every LoRA layer launches its delta, since what runs must not depend on the
    adapters held at capture time."""
    _current.append(LoRAStep(slot_buffer, (), captured=True))
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

    def init_lora(
        self, max_loras: int, max_rank: int, pieces: tuple[str, ...], dtype: torch.dtype, device: torch.device
    ) -> None:
        """Allocate zeroed slot storage for `pieces` (the HF projections filling this layer's output)."""
        self.lora_pieces, self.max_loras, self.max_lora_rank = tuple(pieces), max_loras, max_rank
        self.lora_offsets = [self.lora_slice_rows(p)[0] for p in pieces]
        sizes = [self.lora_slice_rows(p)[1] for p in pieces]
        self.lora_stack = LoRAStack.zeros(
            max_loras, max_rank, self.in_features, self.lora_offsets, sizes, dtype, device
        )  # a [L, S*R, in_local], b [L, R, out_local], ranks [L, S]
        self.lora_a = self.lora_stack.lora_a_views()  # each [L, R, in_local], a view into lora_stack.a
        self.lora_b = self.lora_stack.lora_b_views()  # each [L, out_s, R], a view into lora_stack.b
        self.lora_ranks = [[0] * len(pieces) for _ in range(max_loras)]
        self.lora_cpu_kernel = lora_cpu_supported(dtype, device)

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
        self.lora_stack.ranks[slot] = torch.tensor(self.lora_ranks[slot], dtype=torch.int32)

    def reset_lora(self, slot: int) -> None:
        """Empty `slot`."""
        self.lora_stack.a[slot].zero_()
        self.lora_stack.b[slot].zero_()
        self.lora_stack.ranks[slot] = 0
        self.lora_ranks[slot] = [0] * len(self.lora_pieces)

    def lora_active(self, step: LoRAStep | None) -> bool:
        """Whether a slot of the step holds weights for this layer (else the layer adds nothing); always within a
        captured step."""
        return step is not None and (step.captured or any(any(self.lora_ranks[slot]) for slot in step.active_slots))

    def add_lora(self, x: torch.Tensor, out: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        """`out [T, O] += delta` on the rows of tokens with a slot (in place; `x [T, I]`; out may be a float32 delta
        buffer on CPU); returns out."""
        slots = step.token_slots
        if slots is not None and x.stride(-1) == 1 and out.stride(-1) == 1:
            if self.lora_cpu_kernel and x.is_cpu and x.dtype is self.lora_stack.a.dtype:
                return lora_add_cpu(x, out, slots, self.lora_stack)
            if x.is_cuda:
                return self._add_lora_triton(x, out, step)
        groups = tuple(g for g in step.groups if any(self.lora_ranks[g[0]]))
        add_lora_grouped(x, out, self.lora_a, self.lora_b, self.lora_offsets, self.lora_ranks, groups)
        return out

    def _add_lora_triton(self, x: torch.Tensor, out: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        from vlserve.kernels import triton_lora  # Triton only where there is a GPU

        config = triton_lora.lora_config(x.shape[0])  # [T, I] -> block sizes (depend on T only)
        key = (self.max_loras, config["BLOCK_M"])
        blocks = step.triton_blocks.get(key)
        if blocks is None:  # tokens grouped by slot on the device, once a step
            blocks = step.triton_blocks[key] = triton_lora.lora_token_blocks(
                step.token_slots, self.max_loras, config["BLOCK_M"]
            )
        return triton_lora.add_lora_triton(
            x, out, self.lora_a, self.lora_b, self.lora_offsets, step.token_slots, blocks=blocks, config=config
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, I] -> base [T, O] (+ delta on the step's adapter rows)
        out = super().forward(x)
        step = current_lora_step()
        return self.add_lora(x, out, step) if self.lora_active(step) else out


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
        step = current_lora_step()
        active = self.lora_active(step)
        if self.tp_size == 1:
            out = self.matmul(x, self.bias)
            return self.add_lora(x, out, step) if active else out
        out = self.matmul(x, None)
        out = tp_all_reduce(self.add_lora(x, out, step) if active else out)
        return out if self.bias is None else out + self.bias


class GatedMLPWithLoRA(GatedMLP):
    """GatedMLP whose packed fused `silu(gate) * up` path stays when gate_up has adapter rows: their gate_up delta
    (C++ kernel, into a float32 buffer, zero on base rows) is added to the sums before the activation in the same
    pass, so base rows stay bit-identical. Without the C++ LoRA kernel, adapter rows are recomputed unfused."""

    base_class = GatedMLP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> act [T, I] -> [T, H]
        proj = self.gate_up_proj
        step = current_lora_step()
        fusable = self.hidden_act in ("silu", "swish") and self.intermediate_size % PANEL == 0
        if (
            not isinstance(proj, LoRALayerMixin)
            or not proj.lora_active(step)
            or proj.packed_for(x) is None
            or not fusable
        ):
            return super().forward(x)  # gate_up_proj adds its own delta on the unfused path
        slots = step.token_slots
        if (
            proj.lora_cpu_kernel
            and slots is not None
            and x.dim() == 2
            and x.stride(-1) == 1
            and x.dtype is proj.lora_stack.a.dtype
        ):
            delta = lora_add_cpu(
                x, x.new_zeros(x.shape[0], 2 * self.intermediate_size, dtype=torch.float32), slots, proj.lora_stack
            )  # [T, 2I] float32: gate_up's delta, 0 on base rows
            return self.down_proj(
                cpu_linear_silu_mul(x, proj.packed_weight, proj.bias, self.intermediate_size, delta)
            )  # silu(gate + dg) * (up + du)
        act = cpu_linear_silu_mul(x, proj.packed_weight, proj.bias, self.intermediate_size)  # [T, I]
        for slot, rows in step.groups:
            if not any(proj.lora_ranks[slot]):
                continue
            xs = take_rows(x, rows)  # [n, H]
            one = LoRAStep(None, (slot,), uniform_slot=slot)
            gate_up = proj.add_lora(xs, proj.matmul(xs, proj.bias), one)  # [n, 2I]
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
        step = current_lora_step()
        if self.lora_active(step):
            self.add_lora(x.reshape(-1, self.in_features), out.view(-1, self.out_features), step)  # [R, I] -> [R, O]
        return out


_LORA_CLASSES = {
    QKVParallelLinear: QKVParallelLinearWithLoRA,
    MergedColumnParallelLinear: MergedColumnParallelLinearWithLoRA,
    RowParallelLinear: RowParallelLinearWithLoRA,
    PackableLinear: LinearWithLoRA,
}


def wrap_layer(
    module: torch.nn.Module,
    max_loras: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    pieces: tuple[str, ...] | None = None,
):
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
    for attr in (
        "lora_a",
        "lora_b",
        "lora_ranks",
        "lora_pieces",
        "lora_offsets",
        "max_loras",
        "max_lora_rank",
        "lora_stack",
        "lora_cpu_kernel",
    ):
        module.__dict__.pop(attr, None)
    module.__class__ = base
