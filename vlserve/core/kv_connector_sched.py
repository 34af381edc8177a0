"""The scheduler's part of the KV-connector seam (distributed/kv_transfer), kept beside scheduler.py: a request whose
prefix the connector can load waits in `waiting_for_kv` holding its blocks (not yet in the prefix cache) until a
worker reports the load; then it goes back to the head of `waiting` with `kv_load_done[id]` computed tokens (the
loaded ones, or only its device hit when the load failed, so it recomputes the rest)."""
from __future__ import annotations

from collections import deque

from vlserve.core.request import Request


class KVConnectorScheduling:
    """Mixed into Scheduler (which owns waiting, running, kv, requests, connector, waiting_for_kv, kv_load_done)."""

    def _start_kv_load(self, req: Request, computed_blocks, num_hit: int, num_external: int) -> bool:
        """Give the connector's `num_external` tokens past the device hit their blocks (not registered for prefix
        reuse until loaded) and park the request until a worker reports the load; False when the pool is full."""
        if self.kv.allocate_slots(req, num_external, computed_blocks, delay_cache_blocks=True) is None:
            return False
        self.waiting.popleft()
        req.num_computed_tokens = num_hit
        self.connector.update_state_after_alloc(req, self.kv.get_block_ids(req.request_id)[0], num_external)
        self.waiting_for_kv[req.request_id] = (req, num_hit + num_external)
        return True

    def _resumed_first(self) -> None:
        """Requests whose KV load ended hold their blocks: they go ahead of the queue (a request preempted since
        would otherwise wait at the head for blocks they hold)."""
        done = self.kv_load_done
        if self.waiting and self.waiting[0].request_id not in done:
            resumed = [r for r in self.waiting if r.request_id in done]
            self.waiting = deque(resumed + [r for r in self.waiting if r.request_id not in done])

    def _release_parked(self, keep: Request) -> bool:
        """Nothing runs and the resumed request `keep` finds no room: the other requests that hold blocks without
        running (loaded, or loading) give them back and will start over (their tier blocks are still there).
        False when there was none."""
        if self.running:
            return False
        released = False
        for rid in [r for r in self.kv_load_done if r != keep.request_id]:
            req = self.requests[rid]
            del self.kv_load_done[rid]
            self.kv.free(req)
            req.num_computed_tokens = 0
            released = True
        return released

    def _update_from_kv_output(self, kv_out) -> None:
        """Loads that ended: their requests go back to the head of the queue (a failed one keeps only its device
        hit and recomputes the rest)."""
        self.connector.update_connector_output(kv_out)
        if kv_out.finished_sending:
            self._free_sent(kv_out.finished_sending)
        for rid in kv_out.finished_recving:
            entry = self.waiting_for_kv.pop(rid, None)
            if entry is None:  # aborted meanwhile
                continue
            req, loaded = entry
            self.kv_load_done[rid] = req.num_computed_tokens if rid in kv_out.failed_recving else loaded
            self.waiting.appendleft(req)
