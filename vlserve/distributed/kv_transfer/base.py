"""The KV-connector interface (modelled on vLLM v1's KVConnectorBase_V1), one class with two roles.

Scheduler side (pure Python, in the engine core; no torch):
  `get_num_new_matched_tokens(request, num_computed_tokens)` -> (tokens beyond the device prefix hit that can be
      loaded from outside, whether the load is asynchronous: the request then waits a step for it),
  `update_state_after_alloc(request, block_ids, num_external_tokens)` once the scheduler gave those tokens blocks,
  `build_connector_meta(scheduler_output, scheduler)` -> the step's `KVConnectorMetadata` (None: nothing to do),
      carried to every worker in `SchedulerOutput.kv_connector_metadata`,
  `update_connector_output(output)` with what the workers reported (`KVConnectorOutput`),
  `request_finished(request, block_ids)` -> (keep, kv_transfer_params): keep = True when the connector keeps the
      blocks until they are saved/sent (the scheduler then frees them once a later output lists the request in
      `finished_sending`); kv_transfer_params (or None) go back to the client with the request's last output (a
      producer's: where a consumer finds the blocks).

Worker side (in the model runner, around each step's forward: `ModelRunner.execute_model` is the one seam):
  `register_kv_caches(kv_caches, draft_kv_cache)` once after the KV cache is allocated (per layer a (K, V) pair
      of `[num_blocks, block_size, num_kv_heads, head_dim]` tensors, and the EAGLE draft's own (K, V) pair under
      the same block ids, or None; a transfer engine registers their memory and addresses block b of a layer at
      `data_ptr() + b * stride(0) * element_size()`, see `kv_block_regions`),
  `start_load_kv(metadata)` before the forward, `wait_for_layer_load(layer)` / `save_kv_layer(layer, ...)`
      (optional per-layer hooks), `wait_for_save()` after the forward, and `get_finished()` -> the step's
      `KVConnectorOutput` (loads and saves that ended, loads that failed), returned in `ModelRunnerOutput`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step (a connector subclasses it; plain picklable
    data: it travels in the SchedulerOutput to every rank)."""


@dataclass
class KVConnectorOutput:
    """What a worker reports after a step: requests whose KV load ended (ok or failed) and whose send ended."""

    finished_recving: set[str] = field(default_factory=set)  # loads done (including the failed ones)
    failed_recving: set[str] = field(default_factory=set)  # loads that failed: the request recomputes instead
    finished_sending: set[str] = field(default_factory=set)  # saves/sends done for requests whose blocks were kept
    stats: dict[str, int] = field(default_factory=dict)  # connector counters of this step (summed by the scheduler)
    extra: dict[str, Any] = field(default_factory=dict)  # connector-specific (e.g. tier keys found bad)

    def is_empty(self) -> bool:
        return not (self.finished_recving or self.finished_sending or self.stats or self.extra)


def kv_block_regions(kv_caches, block_id: int) -> list[tuple[int, int]]:
    """(address, nbytes) of block `block_id` in every K and V tensor, layer by layer (what a transfer engine such as
    Mooncake's reads or writes): a block is one contiguous `[block_size, Hkv, D]` page of a layer's tensor."""
    out = []
    for pair in kv_caches:
        if pair is None:  # another pipeline stage's layer
            continue
        for t in pair:
            nbytes = t.stride(0) * t.element_size()
            out.append((t.data_ptr() + block_id * nbytes, nbytes))
    return out


class KVConnectorBase:
    """Base of every connector. `role` says which half this instance serves; the defaults do nothing."""

    def __init__(self, config, role: KVConnectorRole, **context: Any):
        self.config = config  # a vlserve.config.KVTransferConfig
        self.role = role
        self.context = context  # what the side that built it knows (block_size, namespace, rank, ...)

    # -- scheduler side --------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output, scheduler) -> KVConnectorMetadata | None:
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        pass

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return False, None

    def stats(self) -> dict[str, int]:
        """Counters for /metrics, by name without the `vlserve:` prefix."""
        return {}

    # -- worker side -----------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches, draft_kv_cache=None) -> None:
        pass

    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        pass

    def wait_for_layer_load(self, layer: int) -> None:
        pass

    def save_kv_layer(self, layer: int, metadata: KVConnectorMetadata | None) -> None:
        pass

    def wait_for_save(self, metadata: KVConnectorMetadata | None) -> None:
        pass

    def get_finished(self) -> KVConnectorOutput | None:
        return None
