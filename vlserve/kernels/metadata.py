"""Per-step attention metadata that the model runner builds and every attention layer reads."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch


@dataclass
class AttentionMetadata:
    """Describes one flattened step batch of B sequences and T query tokens.

    The runner orders sequences so that the first `num_decodes` have exactly one query token
    (pure decode); their tokens are the first `num_decode_tokens == num_decodes` tokens.
    The remaining sequences are prefill chunks (one or more query tokens over a cached prefix).
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
    # what the kernels derive from this step once and reuse in every layer (gather plans, int64 slots)
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    def derive(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """`build()` the first time `key` is asked for during this step, the same object after that."""
        value = self.derived.get(key)
        if value is None:
            value = self.derived[key] = build()
        return value

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)
