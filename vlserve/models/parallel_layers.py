"""Tensor-parallel building blocks of the decoder (Megatron / vLLM style), sharded by this process's TP rank.

Every layer reads the group size and rank when it is built (`vlserve.distributed.parallel_state`). With one rank
each is exactly the module it replaces (same parameter names and shapes, same single op in `forward`), so
unsharded serving, tying and the EAGLE heads that share `embed_tokens` / `lm_head` see no difference.

With `tp` ranks (`r` = this rank):
- ColumnParallelLinear: output rows split; weight `[O/tp, I]`, the output stays split.
- MergedColumnParallelLinear: several column-parallel matrices stacked (gate_up: `[2I/tp, H]`).
- QKVParallelLinear: q heads split (`Hq/tp`), kv heads split (`Hkv/tp`) or, when `Hkv < tp`, one kv head per
  rank (head `r * Hkv // tp`, the one its q heads attend with).
- RowParallelLinear: input columns split; partial outputs are summed over the ranks, bias added once after.
- VocabParallelEmbedding / ParallelLMHead: vocab rows split, padded up to a multiple of tp; ids outside this rank's
  rows embed to 0 before the sum; local logits are gathered along the vocab and the padding dropped.

On CPUs with AVX-512 or AVX2 + FMA the runner packs the float32 and bf16 linears once loaded
(`PackableLinear.pack_for_cpu`; bf16 with an even in_features): `weight` becomes None and `packed_weight` holds the
matrix in the layout of `kernels.cpu_linear`, whose AVX-512 or AVX2 code path runs it (`cpu_linear_isa`). The LM
head is packed too; when it is tied to the embedding, the embedding keeps the matrix and the head holds a packed
copy (oneDNN's unpacked matmul cost a decode step 0.24 ms at one stream on the bench model, the packed kernel 0.06).
Where torch's matmul beats the kernel from some row count on (bf16 on CPUs with AMX: `onednn_min_rows`), a layer
keeps `weight` beside `packed_weight` and multiplies inputs of that many rows or more with it (prefill chunks and
batched decode on the tile unit, small decode batches through the kernel); towers keep only `weight` there.

Loading: `checkpoint_shard(param, piece)` says which `(dim, start, length)` of a checkpoint tensor this rank reads
(None: the whole tensor), and `load_shard(param, piece, tensor, name)` copies that slice into place. `piece` names
one matrix of a fused parameter ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlserve.distributed.communication import tp_all_gather, tp_all_reduce
from vlserve.distributed.parallel_state import tp_rank, tp_size
from vlserve.kernels.packed_linear import PackableLinear, pack_linears_for_cpu  # noqa: F401 (re-exported)
from vlserve.models.quantization.base import copy_into_rows, layout_of, shard_range

ShardSpec = tuple[int, int, int]  # (dim, start, length) of a checkpoint tensor that this rank reads


def copy_weight(dst: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Copy checkpoint tensor `name` into `dst`; ValueError when the shapes differ."""
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    dst.data.copy_(tensor)


def check_tensor_parallel_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int, tp: int) -> None:
    """ValueError unless a decoder with these sizes can be split over `tp` ranks."""
    if tp == 1:
        return
    if num_heads % tp:
        raise ValueError(f"num_attention_heads ({num_heads}) must be divisible by tensor_parallel_size ({tp})")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) must be a multiple or a divisor of tensor_parallel_size ({tp})"
        )
    if intermediate_size % tp:
        raise ValueError(f"intermediate_size ({intermediate_size}) must be divisible by tensor_parallel_size ({tp})")


def local_kv_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads one rank holds: `Hkv / tp`, or 1 (replicated) when there are fewer KV heads than ranks."""
    return max(1, num_kv_heads // tp)


class ColumnParallelLinear(PackableLinear):
    """`y = x W^T + b` with W's output rows split over the ranks: weight `[O/tp, I]`; the output stays split."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        if out_features % self.tp_size:
            raise ValueError(f"output size {out_features} is not divisible by tensor_parallel_size {self.tp_size}")
        super().__init__(in_features, out_features // self.tp_size, bias=bias)

    def local_rows(self, piece: str | None) -> tuple[int, int]:
        """`(offset, count)` of `piece`'s rows inside this rank's weight (the whole weight here)."""
        return 0, self.out_features

    def checkpoint_rows(self, piece: str | None) -> tuple[int, int]:
        """`(start, count)` of the rows this rank reads from the checkpoint tensor of `piece`."""
        _, count = self.local_rows(piece)
        return self.tp_rank * count, count

    def checkpoint_shard(self, param: str, piece: str | None = None) -> ShardSpec | None:
        """Rows of the checkpoint tensor this rank reads (along the parameter's output dim, in its elements: a
        packed or grouped quantized tensor covers several rows an element); None when unsharded."""
        layout = layout_of(self, param)
        if self.tp_size == 1 or layout.output_dim is None or layout.per_piece_scalar or layout.expand_rows > 1:
            return None
        start, count = self.checkpoint_rows(piece)
        return (layout.output_dim, *shard_range(start, count, layout.output_div, f"{param} of {piece or 'layer'}"))

    def load_shard(self, param: str, piece: str | None, tensor: torch.Tensor, name: str) -> None:
        """Copy this rank's slice of checkpoint tensor `name` into `piece`'s rows of `param`."""
        offset, count = self.local_rows(piece)
        copy_into_rows(self, param, offset, count, tensor, name, source_start=self.checkpoint_rows(piece)[0])


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel matrices stacked along the output (gate_up: pieces gate_proj, up_proj of I rows each)."""

    def __init__(self, in_features: int, pieces: dict[str, int], bias: bool = True) -> None:
        tp = tp_size()
        bad = {p: n for p, n in pieces.items() if n % tp}
        if bad:
            raise ValueError(f"sizes {bad} are not divisible by tensor_parallel_size {tp}")
        super().__init__(in_features, sum(pieces.values()), bias=bias)
        self.piece_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for piece, size in pieces.items():
            self.piece_offsets[piece] = (offset, size // tp)
            offset += size // tp

    def local_rows(self, piece: str | None) -> tuple[int, int]:
        return self.piece_offsets[piece]


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused q/k/v projection split by heads: weight `[(Hq/tp + 2 * Hkv_local) * D, H]`.

    `num_heads` / `num_kv_heads` are this rank's; with fewer KV heads than ranks each rank holds the one KV head
    `r * Hkv // tp` (so the matrices of that head are replicated on `tp / Hkv` ranks).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp, rank = tp_size(), tp_rank()
        self.num_heads = num_heads // tp
        self.num_kv_heads = local_kv_heads(num_kv_heads, tp)
        self.head_dim = head_dim
        self.first_kv_head = rank * num_kv_heads // tp
        q, kv = self.num_heads * head_dim * tp, self.num_kv_heads * head_dim * tp
        super().__init__(hidden_size, {"q_proj": q, "k_proj": kv, "v_proj": kv}, bias=bias)

    def checkpoint_rows(self, piece: str | None) -> tuple[int, int]:
        _, count = self.local_rows(piece)
        if piece == "q_proj":
            return self.tp_rank * count, count
        return self.first_kv_head * self.head_dim, count


class RowParallelLinear(PackableLinear):
    """`y = x W^T + b` with W's input columns split: weight `[O, I/tp]`, input `[T, I/tp]` (a column-parallel
    layer's output); the ranks' partial products are summed, then the (whole, replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        if in_features % self.tp_size:
            raise ValueError(f"input size {in_features} is not divisible by tensor_parallel_size {self.tp_size}")
        super().__init__(in_features // self.tp_size, out_features, bias=bias)
        self.shards_input = self.tp_size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, I/tp] -> partial [T, O] -> summed over ranks [T, O] (+ bias)
        if self.tp_size == 1:
            return self.matmul(x, self.bias)
        out = tp_all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias

    def checkpoint_shard(self, param: str, piece: str | None = None) -> ShardSpec | None:
        """Columns of the weight this rank reads (along the parameter's input dim, in its elements); the bias and
        tensors without an input dim (per-channel scales) are read whole."""
        layout = layout_of(self, param)
        if self.tp_size == 1 or layout.input_dim is None:
            return None
        return (
            layout.input_dim,
            *shard_range(self.tp_rank * self.in_features, self.in_features, layout.input_div, param),
        )

    def load_shard(self, param: str, piece: str | None, tensor: torch.Tensor, name: str) -> None:
        """Copy this rank's columns (or the whole bias) of checkpoint tensor `name`."""
        copy_into_rows(self, param, None, None, tensor, name)


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of a vocab-sized matrix: ids `[start, start + valid)` live in local rows `[0, valid)`;
    local rows `[valid, rows)` are padding (the vocab is padded up to a multiple of tp when tp > 1)."""

    start: int
    rows: int
    valid: int

    @classmethod
    def of(cls, vocab_size: int, rank: int, tp: int) -> VocabShard:
        rows = -(-vocab_size // tp)
        start = rank * rows
        return cls(start, rows, max(0, min(rows, vocab_size - start)))


class _VocabRows:
    """Loading shared by the vocab-parallel layers (which have `tp_size`, `shard` and `weight`)."""

    def checkpoint_shard(self, param: str, piece: str | None = None) -> ShardSpec | None:
        """This rank's vocab rows of the checkpoint matrix; None when unsharded."""
        if self.tp_size == 1:
            return None
        return 0, self.shard.start, self.shard.valid

    def load_shard(self, param: str, piece: str | None, tensor: torch.Tensor, name: str) -> None:
        """Copy this rank's vocab rows and zero the padding rows."""
        if self.tp_size == 1:
            copy_weight(self.weight, tensor, name)
            return
        copy_weight(self.weight.data[: self.shard.valid], tensor, name)
        self.weight.data[self.shard.valid :].zero_()


class VocabParallelEmbedding(_VocabRows, nn.Embedding):
    """Token embedding with the vocab rows split: weight `[ceil(V/tp), H]` (`[V, H]` when tp == 1)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.vocab_size = vocab_size
        self.shard = VocabShard.of(vocab_size, self.tp_rank, self.tp_size)
        super().__init__(self.shard.rows, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, H]; under TP each rank embeds its own ids, zeros elsewhere, then the ranks sum
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.valid)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return tp_all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(_VocabRows, PackableLinear):
    """Output projection with the vocab rows split (weight as VocabParallelEmbedding's, so tying shares it):
    local logits `[N, ceil(V/tp)]` are gathered along the vocab and the padding columns dropped -> `[N, V]`."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.vocab_size = vocab_size
        self.shard = VocabShard.of(vocab_size, self.tp_rank, self.tp_size)
        super().__init__(hidden_size, self.shard.rows, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> local logits [N, V/tp] -> gathered [N, tp * ceil(V/tp)] -> [N, V]
        logits = self.matmul(hidden, None)
        if self.tp_size == 1:
            return logits
        return tp_all_gather(logits, dim=-1)[..., : self.vocab_size]
