"""The draft-proposer protocol: what the runner needs from a speculative-decoding proposer (n-gram, EAGLE, ...).

The runner calls every proposer the same way, without knowing which one it is: after each step it hands
`propose_drafts(DraftInputs)` the requests that sampled and their tokens; a proposer with
`uses_target_hidden_states` also gets the target step's view (its inputs, positions, hidden and aux states, attention
metadata). A proposer that needs KV of its own describes it with `draft_kv_spec()`; the runner allocates that cache
(indexed by the target's block ids) and hands it over with `bind_kv_cache`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from vlserve.kernels.metadata import AttentionMetadata


@dataclass(frozen=True)
class DraftKVSpec:
    """One KV layer of the draft, laid out like the target's: K and V caches of [num_blocks, *block_shape]."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_block(self) -> int:
        return (
            2 * self.block_size * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        )


@dataclass
class DraftInputs:
    """What the runner hands a proposer after a target step.

    Always:
      req_ids:     requests that sampled this step and get drafts.
      token_ids:   their known tokens after sampling (prompt + outputs, no drafts), same order.
    Only for proposers with `uses_target_hidden_states` (None otherwise), T rows in the target's batch order:
      input_ids:         [T] int64 — row of position p holds token p+1 (0 where unknown: rows past a request's
                         last valid row).
      inputs_embeds:     [T, H] | None — the same shifted inputs as embeddings, media merged (multimodal
                         targets); None: embed input_ids.
      positions:         [T] or [3, T] int64 — the target's positions.
      hidden_states:     [T, H] — the target model's output.
      aux_hidden_states: the residual streams at the proposer's `aux_layer_ids`, each [T, H].
      attn_metadata:     the target step's AttentionMetadata.
      last_rows:         [B'] row of each sampled request's last valid position (L - 2, L = its length).
      seq_lens:          [B'] L: tokens known after sampling (drafts sit at positions L, L+1, ...).
      batch_rows:        [B'] its index in the target batch (row of attn_metadata.block_tables).
      num_slots:         [B'] KV slots its block table covers (len(block_ids) * block_size).
      mrope_deltas:      [B'] | None — M-RoPE targets: text position = index + delta.
      batch_req_ids:     [B] every request of the target batch, in batch order.
      batch_starts:      [B] position of each request's first row.
      batch_num_valid:   [B] how many of its rows are valid (know their next token).
    """

    req_ids: list[str]
    token_ids: list[list[int]]
    input_ids: torch.Tensor | None = None
    inputs_embeds: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    aux_hidden_states: list[torch.Tensor] | None = None
    attn_metadata: AttentionMetadata | None = None
    last_rows: np.ndarray | None = None
    seq_lens: np.ndarray | None = None
    batch_rows: np.ndarray | None = None
    num_slots: np.ndarray | None = None
    mrope_deltas: np.ndarray | None = None
    batch_req_ids: list[str] | None = None
    batch_starts: np.ndarray | None = None
    batch_num_valid: np.ndarray | None = None


class Proposer(Protocol):
    """A speculative-decoding draft proposer as the runner sees it."""

    uses_target_hidden_states: bool  # True: DraftInputs carries the target step's view, every step
    aux_layer_ids: Sequence[int]  # target layers whose input residual streams it reads (may be empty)

    def draft_kv_spec(self) -> DraftKVSpec | None:
        """The draft's own KV layer (the runner allocates it), or None."""

    def bind_kv_cache(self, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Receive the KV cache the runner allocated from draft_kv_spec(): K, V [num_blocks, *block_shape]."""

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """Forget finished or preempted requests."""

    def propose_drafts(self, inputs: DraftInputs) -> dict[str, list[int]]:
        """Draft tokens (possibly none) per request of inputs.req_ids; called after every step that ran."""
