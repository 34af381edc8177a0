"""The scheduler side of the KV-connector seam (distributed/kv_transfer): a request whose prefix the connector can
load waits in `waiting_for_kv` holding its blocks (not yet in the prefix cache) until a worker reports the load; then
it goes back to the head of the scheduler's waiting queue with `load_done[id]` computed tokens (the loaded ones, or
only its device hit when the load failed, so it recomputes the rest). A finished request whose blocks the connector
still sends stays in `kept_blocks` until a worker lists it in `finished_sending`."""

from __future__ import annotations

from collections import deque

from vlserve.core.kv_cache_manager import KVCacheManager, block_extra_keys
from vlserve.core.request import Request
from vlserve.distributed.kv_transfer.base import KVConnectorRole
from vlserve.distributed.kv_transfer.factory import create_connector


class KVConnectorState:
    """The KV connector's scheduler side and the requests it holds: parked for a load (`waiting_for_kv`), loaded and
    due back in the waiting queue (`load_done`), finished with blocks kept for sending (`kept_blocks`). Without a
    connector (`connector` None) the three stay empty. The scheduler's queues and KV pool are passed in."""

    def __init__(self, connector=None):
        self.connector = connector
        self.waiting_for_kv: dict[str, tuple[Request, int]] = {}  # id -> (request, computed tokens once loaded)
        self.load_done: dict[str, int] = {}  # id -> computed tokens it resumes with
        self.kept_blocks: dict[str, Request] = {}  # finished; blocks kept until the connector sent them

    @classmethod
    def from_config(cls, config) -> KVConnectorState:
        """The state for a SchedulerConfig: with its `kv_transfer_config`'s connector (scheduler role), or none."""
        if config.kv_transfer_config is None:
            return cls()
        if len(config.kv_group_windows) > 1:
            raise ValueError(
                "KV connectors support models with one KV cache group (no sliding-window layers "
                "beside full ones) for now"
            )
        return cls(
            create_connector(
                config.kv_transfer_config,
                KVConnectorRole.SCHEDULER,
                block_size=config.block_size,
                extra_keys_of=block_extra_keys,
            )
        )

    def num_external_tokens(self, req: Request, num_hit: int) -> int:
        """Tokens past the device prefix hit `num_hit` the connector can load (0 without a connector)."""
        if self.connector is None:
            return 0
        return self.connector.get_num_new_matched_tokens(req, num_hit)[0]

    def start_load(self, req: Request, kv: KVCacheManager, computed_blocks, num_hit: int, num_external: int) -> bool:
        """Give the connector's `num_external` tokens past the device hit their blocks (not registered for prefix
        reuse until loaded) and park the request until a worker reports the load; False when the pool is full (the
        caller takes a parked request off its waiting queue)."""
        if kv.allocate_slots(req, num_external, computed_blocks, delay_cache_blocks=True) is None:
            return False
        req.num_computed_tokens = num_hit
        self.connector.update_state_after_alloc(req, kv.get_block_ids(req.request_id)[0], num_external)
        self.waiting_for_kv[req.request_id] = (req, num_hit + num_external)
        return True

    def resumed_first(self, waiting: deque[Request]) -> deque[Request]:
        """`waiting` with the requests whose KV load ended ahead (they hold their blocks: a request preempted since
        would otherwise wait at the head for blocks they hold)."""
        done = self.load_done
        if not waiting or waiting[0].request_id in done:
            return waiting
        resumed = [r for r in waiting if r.request_id in done]
        return type(waiting)(resumed + [r for r in waiting if r.request_id not in done])  # (the same queue class)

    def release_parked(self, keep: Request, requests: dict[str, Request], kv: KVCacheManager) -> bool:
        """Nothing runs and the resumed request `keep` finds no room: the other requests that hold blocks without
        running (loaded) give them back and will start over (their tier blocks are still there). False when there
        was none."""
        released = False
        for rid in [r for r in self.load_done if r != keep.request_id]:
            req = requests[rid]
            del self.load_done[rid]
            kv.free(req)
            req.num_computed_tokens = 0
            released = True
        return released

    def update_from_output(self, kv_out, kv: KVCacheManager) -> list[Request]:
        """Fold a worker's KVConnectorOutput in: free the kept blocks that were sent, and return the requests whose
        load ended, in report order (each goes to the head of the waiting queue; a failed one keeps only its device
        hit and recomputes the rest)."""
        self.connector.update_connector_output(kv_out)
        for rid in kv_out.finished_sending or ():
            req = self.kept_blocks.pop(rid, None)
            if req is not None:
                kv.free(req)
        resumed = []
        for rid in kv_out.finished_recving:
            entry = self.waiting_for_kv.pop(rid, None)
            if entry is None:  # aborted meanwhile
                continue
            req, loaded = entry
            self.load_done[rid] = req.num_computed_tokens if rid in kv_out.failed_recving else loaded
            resumed.append(req)
        return resumed

    def drop(self, request_id: str) -> bool:
        """Forget an ending request's load; True when it was parked in `waiting_for_kv` (so in no queue)."""
        self.load_done.pop(request_id, None)
        return self.waiting_for_kv.pop(request_id, None) is not None

    def release_blocks(self, req: Request, kv: KVCacheManager) -> dict | None:
        """Free a finished request's KV blocks, unless the connector keeps them until they are sent (then they are
        freed by `update_from_output` once a worker lists the request in `finished_sending`, which a producer's
        worker does on the consumer's confirmation or a timeout). Returns the connector's kv_transfer_params for the
        client (or None)."""
        keep, params = False, None
        if self.connector is not None:
            block_ids = kv.get_block_ids(req.request_id)
            keep, params = self.connector.request_finished(req, block_ids[0] if block_ids else [])
        if keep:
            self.kept_blocks[req.request_id] = req
        else:
            kv.free(req)
        return params

    def gauges(self, kv: KVCacheManager) -> dict[str, int]:
        """The blocks and requests kept for a peer, and the requests waiting for remote / offloaded KV."""
        kept = sum(len(ids) for rid in self.kept_blocks for ids in kv.get_block_ids(rid))
        return {
            "kv_kept_blocks": kept,
            "kv_kept_requests": len(self.kept_blocks),
            "num_requests_waiting_for_kv": len(self.waiting_for_kv),
        }

    def check_integrity(self, held: set[str], requests: dict[str, Request]) -> None:
        """Kept requests hold blocks (`held`: the ids the KV pool holds blocks for) and are no longer alive."""
        assert set(self.kept_blocks) <= held, f"kept blocks not held: {set(self.kept_blocks) - held}"
        assert not set(self.kept_blocks) & set(requests), "a request both alive and kept for sending"
