"""The P2P connector's worker half: the transfer agent over this rank's KV cache, the producer's side channel and
kept-block deadlines, and the consumer's reads on a background thread (their blocks belong to requests parked in
the scheduler's `waiting_for_kv`, which no forward touches)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from vlserve.distributed.kv_transfer.base import KVConnectorOutput
from vlserve.distributed.kv_transfer.p2p.agent import CacheDescriptor, TransferAgent
from vlserve.distributed.kv_transfer.p2p.side_channel import SideChannelServer, ask

logger = logging.getLogger(__name__)


class P2PWorker:
    def __init__(self, host: str, side_channel_port: int | None, send_timeout_s: float):
        self.host = host
        self.side_channel_port = side_channel_port  # a producer's, else None
        self.send_timeout_s = send_timeout_s
        self.agent: TransferAgent | None = None
        self.server: SideChannelServer | None = None
        self._lock = threading.Lock()
        self._confirmed: set[str] = set()  # the consumer said done (side channel thread)
        self._deadlines: dict[str, float] = {}  # kept requests -> when to give up on the consumer
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-p2p-read")
        # the "done" messages: after the read, never delaying its report (a hung producer takes ask's timeout)
        self._notify = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-p2p-done")
        self._reads: dict[str, Future] = {}
        self._peers: dict[tuple[str, int, str], CacheDescriptor] = {}

    def register_kv_caches(self, kv_caches, draft_kv_cache=None) -> None:
        self.agent = TransferAgent(self.host)
        self.agent.register(kv_caches, draft_kv_cache)
        if self.side_channel_port is not None:
            self.server = SideChannelServer(
                self.host, self.side_channel_port, lambda: self.agent.describe().to_dict(), self._on_done
            )

    def _on_done(self, request_id: str) -> None:
        with self._lock:
            self._confirmed.add(request_id)

    def start(self, meta) -> None:
        now = time.monotonic()
        for rid in meta.new_sends:
            self._deadlines[rid] = now + self.send_timeout_s
        for rid, load in meta.loads.items():
            self._reads[rid] = self._pool.submit(self._read, load)

    def _read(self, load) -> tuple[bool, int]:
        """Read the producer's blocks, then have it told to free them; (ok, blocks read)."""
        ok = True
        try:
            if load.remote_block_ids:
                key = (load.host, load.port, load.remote_engine_id)
                peer = self._peers.get(key)
                if peer is None:
                    peer = self._peers[key] = CacheDescriptor.from_dict(
                        ask(load.host, load.port, {"op": "describe"})["cache"]
                    )
                    if self.agent.draft_block_bytes and not self.agent.reads_draft_from(peer):
                        logger.warning(
                            "the producer at %s:%s runs no EAGLE draft like this server's: its drafts "
                            "will see no prompt KV (fewer accepted, same output); start the prefill "
                            "server with the same --speculative-config",
                            load.host,
                            load.port,
                        )
                ok = self.agent.read_blocks(peer, load.remote_block_ids, load.local_block_ids)
        except Exception as e:  # noqa: BLE001 - a failed read recomputes
            logger.warning("KV read from %s:%s failed: %s", load.host, load.port, e)
            ok = False
        self._notify.submit(_tell_done, load)
        return ok, len(load.remote_block_ids)

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        if self._reads and not any(f.done() for f in self._reads.values()):
            time.sleep(0.001)  # an empty step that only polls: leave the core to the read
        for rid, fut in list(self._reads.items()):
            if fut.done():
                del self._reads[rid]
                ok, n = fut.result()
                out.finished_recving.add(rid)
                if not ok:
                    out.failed_recving.add(rid)
                else:
                    out.stats["loaded_blocks"] = out.stats.get("loaded_blocks", 0) + n
                    out.stats["loads_done"] = out.stats.get("loads_done", 0) + 1
        if self._deadlines:
            with self._lock:
                confirmed = self._confirmed & self._deadlines.keys()  # (one may come before its new_sends)
                self._confirmed -= confirmed
            now = time.monotonic()
            for rid, deadline in list(self._deadlines.items()):
                if rid in confirmed or now >= deadline:
                    stat = "sends_confirmed" if rid in confirmed else "send_timeouts"
                    out.stats[stat] = out.stats.get(stat, 0) + 1
                    if rid not in confirmed:
                        logger.warning(
                            "request %s: no consumer read its KV within %.0f s; freeing it", rid, self.send_timeout_s
                        )
                    del self._deadlines[rid]
                    out.finished_sending.add(rid)
        return out


def _tell_done(load) -> None:
    """Tell the producer that `load`'s blocks are read (or given up on), so it frees them."""
    try:
        ask(load.host, load.port, {"op": "done", "request_id": load.remote_request_id})
    except Exception as e:  # noqa: BLE001 - the producer frees them on its timeout then
        logger.warning(
            "could not tell %s:%s that request %s is read: %s", load.host, load.port, load.remote_request_id, e
        )
