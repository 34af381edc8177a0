"""The worker side's transfer agent: Mooncake's TransferEngine over this rank's KV cache tensors (workers only).

It registers every layer's K and V tensor once (`register`); `describe()` is what a peer needs to address this
cache's blocks (the engine's RPC endpoint, each tensor's base address and bytes per block, in the order of
`kv_block_regions`); `read_blocks(peer, remote_ids, local_ids)` pulls the peer's blocks into local ones with one
batched read (the consumer pulls: the producer's compute is never interrupted). Both caches must share the layout
(same model, KV dtype, block size, layers): `check_compatible` refuses a peer that differs. An EAGLE draft's own
KV layer (same block ids) is described apart and read too when both sides run the same draft; otherwise only the
target's layers move (the consumer's drafts then see no prompt KV: fewer accepted, output unchanged).

Mooncake is optional (`pip install vlserve[kv]`, the non-CUDA wheel `mooncake-transfer-engine-non-cuda` on hosts
without CUDA); importing this module without it raises an ImportError that says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from vlserve.distributed.kv_transfer.base import kv_block_regions

logger = logging.getLogger(__name__)


def _transfer_engine_class():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # pragma: no cover - depends on the host
        raise ImportError(
            "the P2P KV connector needs Mooncake's transfer engine: pip install 'vlserve[kv]' "
            "(mooncake-transfer-engine, or mooncake-transfer-engine-non-cuda without CUDA)"
        ) from e
    return TransferEngine


@dataclass
class CacheDescriptor:
    """How a peer addresses this cache: block b of tensor i lives at bases[i] + b * block_bytes[i] (the target's
    K / V tensors), and of the EAGLE draft's K / V at draft_bases[i] + b * draft_block_bytes[i] (empty: no draft)."""

    session: str  # "host:rpc_port", Mooncake's target name
    bases: list[int]
    block_bytes: list[int]
    num_blocks: int
    draft_bases: list[int] = field(default_factory=list)
    draft_block_bytes: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "session": self.session,
            "bases": self.bases,
            "block_bytes": self.block_bytes,
            "num_blocks": self.num_blocks,
            "draft_bases": self.draft_bases,
            "draft_block_bytes": self.draft_block_bytes,
        }

    @classmethod
    def from_dict(cls, d: dict) -> CacheDescriptor:
        return cls(
            d["session"],
            [int(x) for x in d["bases"]],
            [int(x) for x in d["block_bytes"]],
            int(d["num_blocks"]),
            [int(x) for x in d.get("draft_bases", [])],
            [int(x) for x in d.get("draft_block_bytes", [])],
        )


class TransferAgent:
    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = ""):
        self.host = host
        self.engine = _transfer_engine_class()()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) failed: {rc}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.bases: list[int] = []
        self.block_bytes: list[int] = []
        self.draft_bases: list[int] = []
        self.draft_block_bytes: list[int] = []
        self.num_blocks = 0
        self._registered: list[tuple[int, int]] = []

    def register(self, kv_caches, draft_kv_cache=None) -> None:
        """Register every K / V tensor of this rank (layer by layer, skipping other stages' layers), and the EAGLE
        draft's pair if any."""
        tensors = [t for pair in kv_caches if pair is not None for t in pair]
        self.num_blocks = tensors[0].shape[0] if tensors else 0
        self._register(kv_caches, self.bases, self.block_bytes)
        if draft_kv_cache is not None:
            self._register([draft_kv_cache], self.draft_bases, self.draft_block_bytes)

    def _register(self, kv_caches, bases: list[int], block_bytes: list[int]) -> None:
        tensors = [t for pair in kv_caches if pair is not None for t in pair]
        regions = kv_block_regions(kv_caches, 0)
        assert len(tensors) == len(regions)
        for t, (base, nbytes) in zip(tensors, regions):
            size = nbytes * t.shape[0]
            rc = self.engine.register_memory(base, size)
            if rc != 0:
                raise RuntimeError(f"Mooncake register_memory({size} bytes) failed: {rc}")
            self._registered.append((base, size))
            bases.append(base)
            block_bytes.append(nbytes)

    def describe(self) -> CacheDescriptor:
        return CacheDescriptor(
            self.session,
            list(self.bases),
            list(self.block_bytes),
            self.num_blocks,
            list(self.draft_bases),
            list(self.draft_block_bytes),
        )

    def reads_draft_from(self, peer: CacheDescriptor) -> bool:
        """Whether both caches hold the same EAGLE draft layer (then its blocks move with the target's)."""
        return bool(self.draft_block_bytes) and peer.draft_block_bytes == self.draft_block_bytes

    def check_compatible(self, peer: CacheDescriptor) -> None:
        if peer.block_bytes != self.block_bytes:
            raise ValueError(
                f"the peer's KV cache layout differs ({len(peer.block_bytes)} tensors, block bytes "
                f"{peer.block_bytes[:2]}..; here {len(self.block_bytes)}, {self.block_bytes[:2]}..): "
                f"prefill and decode must run the same model, KV dtype and block size"
            )

    def read_blocks(self, peer: CacheDescriptor, remote_ids: list[int], local_ids: list[int]) -> bool:
        """Copy the peer's blocks `remote_ids` into this cache's `local_ids` (one batched synchronous read,
        adjacent blocks merged into one region). True on success."""
        self.check_compatible(peer)
        if len(remote_ids) != len(local_ids):
            raise ValueError(f"{len(remote_ids)} remote blocks for {len(local_ids)} local ones")
        if any(not 0 <= r < peer.num_blocks for r in remote_ids) or any(
            not 0 <= b < self.num_blocks for b in local_ids
        ):
            raise ValueError("a block id is out of range")
        dst, src, lens = [], [], []
        tensors = list(zip(self.bases, peer.bases, self.block_bytes))
        if self.reads_draft_from(peer):
            tensors += zip(self.draft_bases, peer.draft_bases, self.draft_block_bytes)
        for run_local, run_remote, n in _runs(local_ids, remote_ids):
            for base, rbase, nbytes in tensors:
                dst.append(base + run_local * nbytes)
                src.append(rbase + run_remote * nbytes)
                lens.append(n * nbytes)
        if not dst:
            return True
        rc = self.engine.batch_transfer_sync_read(peer.session, dst, src, lens)
        if rc != 0:
            logger.warning("KV read of %d blocks from %s failed: %s", len(local_ids), peer.session, rc)
        return rc == 0

    def close(self) -> None:
        for base, _ in self._registered:
            try:
                self.engine.unregister_memory(base)
            except Exception:  # pragma: no cover
                pass
        self._registered = []


def _runs(local_ids: list[int], remote_ids: list[int]):
    """(first local id, first remote id, length) of the runs where both lists go up by one together."""
    out = []
    for lo, ro in zip(local_ids, remote_ids):
        if out and out[-1][0] + out[-1][2] == lo and out[-1][1] + out[-1][2] == ro:
            out[-1][2] += 1
        else:
            out.append([lo, ro, 1])
    return [tuple(r) for r in out]
