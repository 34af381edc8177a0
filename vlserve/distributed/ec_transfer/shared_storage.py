"""The shared-storage encoder-cache connector (vLLM's ECSharedStorageConnector), worker side only.

A producer writes every media item's encoder output (`[n, H]`) it computes to `<shared_storage_path>/<namespace>/`,
one file per item named by its mm_hash; a consumer, for an item whose file is there, loads it instead of running the
tower. The namespace (`engine/kv_transfer_setup.encoder_namespace`) folds in the checkpoint, its dtype and the
tower's identity, so different models never share a file. Files are the offloading tier's checksummed format
(`offloading/tier_store.write_checked_file`: JSON header with dtype, shape, size and blake2b, then the payload,
renamed into place). A missing file is a miss; a file that fails any check (or whose row count is not the item's
placeholder length) is logged, counted, deleted, and the item is encoded locally. The scheduler never sees this
connector: it budgets the encoder cache as always; only the tower run is skipped (`worker/encoder_runs.py`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re

import torch

from vlserve.distributed.kv_transfer.offloading.tier_store import TierFileError, read_checked_file, write_checked_file

logger = logging.getLogger(__name__)

FORMAT = "vlserve-ec-item-1"
FILE_SUFFIX = ".ect"
_SAFE_NAME = re.compile(r"[0-9A-Za-z_.-]{1,128}")


class ECSharedStorageConnector:
    def __init__(self, config, device: torch.device, dtype: torch.dtype):
        extra = config.ec_connector_extra_config
        if "_namespace" not in extra:
            raise ValueError("ec_transfer_config was not resolved against the model (no namespace)")
        self.dir = os.path.join(extra["shared_storage_path"], extra["_namespace"])
        os.makedirs(self.dir, exist_ok=True)
        self.is_producer, self.is_consumer = config.is_producer, config.is_consumer
        self.device, self.dtype = device, dtype
        self.counters = {
            "ec_load_hits_total": 0,
            "ec_load_misses_total": 0,
            "ec_load_failures_total": 0,
            "ec_stores_total": 0,
            "ec_store_failures_total": 0,
        }
        self._warned_write = False

    def path(self, mm_hash: str) -> str:
        name = (
            mm_hash
            if _SAFE_NAME.fullmatch(mm_hash) and not mm_hash.startswith(".")
            else "h-" + hashlib.blake2b(mm_hash.encode(), digest_size=16).hexdigest()
        )
        return os.path.join(self.dir, name + FILE_SUFFIX)

    def load(self, mm_hash: str, length: int) -> torch.Tensor | None:
        """The item's `[length, H]` embeddings on the runner's device, or None (missing or bad: encode it)."""
        if not self.is_consumer:
            return None
        path = self.path(mm_hash)
        if not os.path.exists(path):
            self.counters["ec_load_misses_total"] += 1
            return None
        try:
            emb = read_checked_file(path, FORMAT, self.dtype, [length, -1])
        except TierFileError as e:
            logger.warning("EC shared storage: item %s is encoded locally: %s", mm_hash, e)
            self.counters["ec_load_failures_total"] += 1
            try:
                os.remove(path)
            except OSError:
                pass
            return None
        self.counters["ec_load_hits_total"] += 1
        return emb.to(self.device)

    def save(self, mm_hash: str, emb: torch.Tensor) -> None:
        """Write one item's embeddings (a producer's; an existing file is kept)."""
        if not self.is_producer:
            return
        path = self.path(mm_hash)
        if os.path.exists(path):
            return
        try:
            write_checked_file(path, FORMAT, emb)
        except OSError as e:
            self.counters["ec_store_failures_total"] += 1
            if not self._warned_write:
                logger.warning("EC shared storage: could not write %s (%s)", path, e)
                self._warned_write = True
            return
        self.counters["ec_stores_total"] += 1
