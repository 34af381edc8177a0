"""OffloadingConnector: full blocks computed on the device are stored to a host-memory tier (LRU, `num_cpu_blocks`
slots) and, with a `disk_dir`, written through to one file per block there (which outlives the engine); a new
request whose prefix misses on the device but hits a tier gets blocks and loads them instead of recomputing.

Scheduler side (this module, no torch): the tier index (host LRU: key -> slot; disk: the set of keys with a file),
the stable keys of each request's blocks (`keys.py`), and per step the loads and stores for the workers. A load is
asynchronous in the scheduler's sense: the request waits one step (its blocks allocated, not registered in the
prefix cache), the worker loads before that step's forward, and its report lets the request in with the loaded
tokens computed, or, when a file was bad, with only its device hit (it recomputes the rest; never a wrong token).
Stores run after the forward of the step that completed the block, before any later step can reuse the block.

Worker side: `tier_store.TierStore` (imported only by a worker) copies blocks between the KV tensors, the host
buffer and the files.

extra config: cpu_bytes_to_use (host tier size; `--kv-offloading-size` GiB), disk_dir (`--kv-offloading-dir`),
disk_bytes_to_use (the disk tier's cap; `--kv-offloading-dir-size` GiB: past it the least recently used files are
deleted, files an earlier engine left by their mtime; the cap is this engine's view of its own namespace folder),
and what the engine fills in: _num_cpu_blocks, _disk_max_blocks (the cap in files), _namespace (hex).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field

from vlserve.distributed.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from vlserve.distributed.kv_transfer.offloading.keys import extend_block_keys

logger = logging.getLogger(__name__)

NO_SLOT = -1
FILE_SUFFIX = ".kvb"


def tier_dir(disk_dir: str, namespace_hex: str, rank: int = 0) -> str:
    """Where one rank's block files of one model live: `<disk_dir>/<namespace>/rank<r>`."""
    return os.path.join(disk_dir, namespace_hex, f"rank{rank}")


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    # request -> its blocks to load: (device block id, host slot or NO_SLOT (read the file), key)
    loads: dict[str, list[tuple[int, int, bytes]]] = field(default_factory=dict)
    # (device block id, host slot or NO_SLOT, key, write the file too)
    stores: list[tuple[int, int, bytes, bool]] = field(default_factory=list)
    evictions: list[bytes] = field(default_factory=list)  # files to delete before this step's writes


class OffloadingConnector(KVConnectorBase):
    def __init__(
        self, config, role: KVConnectorRole, block_size: int = 16, extra_keys_of=None, rank: int = 0, **context
    ):
        super().__init__(config, role, block_size=block_size, rank=rank, **context)
        extra = config.kv_connector_extra_config
        self.block_size = block_size
        self.num_cpu_blocks = int(extra.get("_num_cpu_blocks", 0))
        namespace_hex = extra.get("_namespace", "0" * 32)
        self.namespace = bytes.fromhex(namespace_hex)
        disk_dir = extra.get("disk_dir")
        self.disk_dir = None if disk_dir is None else tier_dir(disk_dir, namespace_hex, rank)
        if self.num_cpu_blocks <= 0 and self.disk_dir is None:
            raise ValueError(
                "the OffloadingConnector needs a host tier (kv_offloading_size / cpu_bytes_to_use "
                "large enough for one block) or a disk tier (kv_offloading_dir / disk_dir)"
            )
        self.store_enabled, self.load_enabled = config.is_producer, config.is_consumer
        self.worker = None
        if role == KVConnectorRole.WORKER:
            from vlserve.distributed.kv_transfer.offloading.tier_store import TierStore  # torch: workers only

            self.worker = TierStore(self.num_cpu_blocks, self.disk_dir)
            return
        self._extra_keys_of = extra_keys_of
        self.host: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self.free_slots = list(range(self.num_cpu_blocks - 1, -1, -1))
        self.counters = {
            "kv_offload_hit_tokens_total": 0,
            "kv_offload_stores_total": 0,
            "kv_offload_evictions_total": 0,
            "kv_offload_load_failures_total": 0,
            "kv_offload_store_failures_total": 0,
            "kv_offload_disk_evictions_total": 0,
        }
        self.disk: OrderedDict[bytes, None] = OrderedDict()  # keys with a file, least recently used first
        self.disk_max_blocks = int(extra.get("_disk_max_blocks", 0)) or None  # None: no cap
        self._evictions: list[bytes] = []  # disk keys dropped from the index, their files not deleted yet
        if self.disk_dir is not None:
            os.makedirs(self.disk_dir, exist_ok=True)
            self._index_disk()
        self._loads: dict[str, list[tuple[int, int, bytes]]] = {}  # planned this step
        self._pending: dict[str, int] = {}  # request -> tokens being loaded (until a worker reports)
        self._stored_upto: dict[str, int] = {}  # request -> blocks already considered for storing

    # -- scheduler side --------------------------------------------------------------------------------------
    def _keys(self, request, num_blocks: int) -> list[bytes]:
        return extend_block_keys(request, num_blocks, self.block_size, self.namespace, self._extra_keys_of)

    def _index_disk(self) -> None:
        """The files an earlier engine (or another one) left, oldest first; those over the cap go first."""
        found = []
        for name in os.listdir(self.disk_dir):
            if name.endswith(FILE_SUFFIX) and len(name) == 32 + len(FILE_SUFFIX):
                try:
                    found.append((os.stat(os.path.join(self.disk_dir, name)).st_mtime_ns, bytes.fromhex(name[:32])))
                except (OSError, ValueError):
                    continue
        for _, key in sorted(found):
            self.disk[key] = None
        self._evict_over_cap()

    def _evict_over_cap(self) -> None:
        """Drop the least recently used disk keys past the cap; their files are deleted in the step's metadata,
        after that step's loads and before its writes."""
        while self.disk_max_blocks is not None and len(self.disk) > self.disk_max_blocks:
            key, _ = self.disk.popitem(last=False)
            self._evictions.append(key)
            self.counters["kv_offload_disk_evictions_total"] += 1

    def _in_tier(self, key: bytes) -> bool:
        return key in self.host or key in self.disk

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.load_enabled or not (self.host or self.disk):
            return 0, False
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs  # at least one token is left to compute
        start = num_computed_tokens // bs
        n = start
        while n < max_blocks and self._in_tier(self._keys(request, n + 1)[n]):
            n += 1
        return (n - start) * bs, n > start

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        start = request.num_computed_tokens // self.block_size
        end = start + num_external_tokens // self.block_size
        keys = self._keys(request, end)
        loads = []
        for i in range(start, end):
            key = keys[i]
            slot = self.host.get(key, NO_SLOT)
            if slot != NO_SLOT:
                self.host.move_to_end(key)
            if key in self.disk:
                self.disk.move_to_end(key)
            loads.append((block_ids[i], slot, key))
        self._loads[request.request_id] = loads
        self._pending[request.request_id] = num_external_tokens
        self._stored_upto[request.request_id] = end

    def _take_slot(self) -> int:
        if self.free_slots:
            return self.free_slots.pop()
        _, slot = self.host.popitem(last=False)  # the least recently used block leaves the host tier
        self.counters["kv_offload_evictions_total"] += 1
        return slot

    def build_connector_meta(self, scheduler_output, scheduler) -> OffloadingConnectorMetadata | None:
        stores = []
        if self.store_enabled:
            bs, requests, host, disk = self.block_size, scheduler.requests, self.host, self.disk
            to_disk_ok = self.disk_dir is not None
            for rid in scheduler_output.num_scheduled_tokens:
                req = requests[rid]
                full = min(req.num_computed_tokens, req.num_tokens) // bs  # blocks whose KV this step completes
                done = self._stored_upto.get(rid, 0)
                if full <= done:
                    continue
                keys, blocks = self._keys(req, full), scheduler.kv.req_to_blocks[rid][0]
                for i in range(done, full):
                    key = keys[i]
                    in_host = key in host
                    if in_host:
                        host.move_to_end(key)
                    to_disk = to_disk_ok and key not in disk
                    if to_disk_ok and not to_disk:
                        disk.move_to_end(key)
                    if in_host and not to_disk:
                        continue
                    slot = self._take_slot() if self.num_cpu_blocks and not in_host else NO_SLOT
                    if slot == NO_SLOT and not to_disk:
                        continue
                    stores.append((blocks[i].block_id, slot, key, to_disk))
                    if slot != NO_SLOT:
                        host[key] = slot
                    if to_disk:
                        disk[key] = None
                    self.counters["kv_offload_stores_total"] += 1
                self._stored_upto[rid] = full
        loads, self._loads = self._loads, {}
        if self.disk_max_blocks is not None and len(self.disk) > self.disk_max_blocks:
            self._evict_over_cap()
            evicted = set(self._evictions)  # a file this step would write and evict at once: not written
            stores = [
                (b, slot, key, to_disk and key not in evicted)
                for b, slot, key, to_disk in stores
                if slot != NO_SLOT or key not in evicted
            ]
        evictions, self._evictions = self._evictions, []
        if not stores and not loads and not evictions:
            return None
        return OffloadingConnectorMetadata(loads, stores, evictions)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_recving:
            n = self._pending.pop(rid, 0)
            if rid in output.failed_recving:
                self.counters["kv_offload_load_failures_total"] += 1
            else:
                self.counters["kv_offload_hit_tokens_total"] += n
        for key in output.extra.get("bad_keys", ()):  # a file that failed its checks (now deleted)
            self.disk.pop(key, None)
        for key in output.extra.get("failed_store_keys", ()):  # a file that could not be written (disk full)
            self.disk.pop(key, None)
            self.counters["kv_offload_store_failures_total"] += 1

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._stored_upto.pop(request.request_id, None)
        return False, None  # stores run in the step that completed a block: nothing left to wait for

    def stats(self) -> dict[str, int]:
        return {**self.counters, "kv_offload_host_blocks": len(self.host), "kv_offload_disk_blocks": len(self.disk)}

    # -- worker side -----------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches, draft_kv_cache=None) -> None:
        self.worker.register_kv_caches(kv_caches, draft_kv_cache)

    def start_load_kv(self, metadata) -> None:
        if metadata is not None and metadata.loads:
            self.worker.load(metadata.loads)

    def wait_for_save(self, metadata) -> None:
        if metadata is not None and metadata.evictions:
            self.worker.evict(metadata.evictions)
        if metadata is not None and metadata.stores:
            self.worker.store(metadata.stores)

    def get_finished(self) -> KVConnectorOutput | None:
        return self.worker.take_output()
