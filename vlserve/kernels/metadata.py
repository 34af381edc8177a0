"""Per-step attention metadata that the model runner builds and every attention layer reads."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Describes one flattened step batch of B sequences and T query tokens.

    The runner orders sequences so that the first `num_decodes` have exactly one query token
    (pure decode); their tokens are the first `num_decode_tokens == num_decodes` tokens.
    The remaining sequences are prefill chunks (one or more query tokens over a cached prefix).
    With `key_limits`, a query at position q with limit h attends key k iff k <= h (and, with a sliding window W,
    k > q - W: the window counts back from q itself), as HF's Gemma 3 masks do for its image tokens.
    """

    slot_mapping: torch.Tensor  # [T] int64: flat KV slot (block_id * block_size + offset); -1 = padding, skip
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths, starts at 0
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached prefix + this step's tokens)
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32: physical block ids; unused entries are 0
    num_decodes: int  # sequences [0, num_decodes) are single-token decodes
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]  # same as query_start_loc, as Python ints (no device sync needed)
    seq_lens_cpu: list[int]  # same as seq_lens, as Python ints
    workspace: torch.Tensor | None = None  # flat scratch for the torch decode path, owned by the runner
    # [T] int64 on the step's device: the highest key position each query token may attend (its own position, or the
    # last position of the bidirectional image run it belongs to); None: causal. Positions are absolute (query i of a
    # sequence sits at seq_len - q_len + i); each limit is < its sequence's seq_len, and a decode's is its own position
    key_limits: torch.Tensor | None = None
    # [K] int64, increasing: the only rows of the step whose final hidden states are read (a pooling step's last
    # prompt tokens); the last decoder layer then runs its o_proj and MLP on them alone and the model returns [K, H].
    # None: every row
    output_rows: torch.Tensor | None = None
    # per decoder layer, the metadata of its KV cache group (its own slot_mapping and block_tables; the rest the
    # same), when the model keeps several groups (core/kv_cache_groups.py); None: every layer reads this one
    layer_views: list[AttentionMetadata] | None = field(default=None, repr=False, compare=False)
    # what the kernels derive from this step once and reuse in every layer (gather plans, int64 slots)
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    def derive(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """`build()` the first time `key` is asked for during this step, the same object after that."""
        value = self.derived.get(key)
        if value is None:
            value = self.derived[key] = build()
        return value

    def for_layer(self, layer_idx: int) -> AttentionMetadata:
        """The metadata decoder layer `layer_idx` attends with (its KV cache group's view, else this)."""
        return self if self.layer_views is None else self.layer_views[layer_idx]

    def set_key_limits(self, key_limits: torch.Tensor | None) -> None:
        """Set `key_limits` here and on every group view."""
        self.key_limits = key_limits
        for view in self.layer_views or ():
            view.key_limits = key_limits

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)
