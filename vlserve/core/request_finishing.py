"""How the scheduler's requests end (kept beside scheduler.py): aborts, finishes from outside (stop strings), failed
adapters and grammars, the freeing of a finished request's KV blocks and encoder references (through the KV
connector's `request_finished`), and the queue / integrity introspection."""
from __future__ import annotations

import logging

from vlserve.core.grammar_sync import grammar_error
from vlserve.core.request import Request, RequestStatus
from vlserve.core.sched_output import EngineCoreOutput

logger = logging.getLogger(__name__)


class RequestFinishing:
    """Mixed into Scheduler (which owns requests, waiting, running, waiting_for_kv, kv_load_done, kv, encoder_cache,
    connector, failed, finished_req_ids)."""

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Finish these requests now; returns the ids that were still alive."""
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif self.waiting_for_kv.pop(rid, None) is None:
                self.waiting.remove(req)
            self.kv_load_done.pop(rid, None)
            req.status = RequestStatus.FINISHED_ABORTED
            self._free_request(req)
            aborted.append(rid)
        return aborted

    def take_failed(self) -> list[EngineCoreOutput]:
        """The requests that ended while waiting since the last step's results (reported with the next ones)."""
        failed, self.failed = self.failed, []
        return failed

    def fail_lora(self, lora_int_id: int, error: str) -> None:
        """The adapter failed to load: its waiting requests end "abort" with the error."""
        self.loras_loading.discard(lora_int_id)
        for req in [r for r in self.waiting if r.lora_int_id == lora_int_id]:
            self.waiting.remove(req)
            req.status = RequestStatus.FINISHED_ABORTED
            logger.error("request %s: its LoRA adapter did not load: %s", req.request_id, error)
            self.failed.append(EngineCoreOutput(req.request_id, [], "abort", extra={"error": error}))
            self._free_request(req)

    def _abort_failed_grammar(self, req: Request) -> None:
        """A request whose grammar did not compile ends "abort" (the front end validates first, so this is rare)."""
        req.status = RequestStatus.FINISHED_ABORTED
        logger.error("request %s: its grammar did not compile: %s", req.request_id, grammar_error(req))
        self.failed.append(EngineCoreOutput(req.request_id, [], "abort", extra={"error": grammar_error(req)}))
        self._free_request(req)

    def _fail_remote_media(self, req: Request) -> None:
        """A disaggregated consumer's request (the waiting queue's head) that must recompute a media item its
        producer encoded (the KV read failed, or its blocks were evicted since): it has no media, so it ends "abort"
        with the error."""
        self.waiting.popleft()
        self.kv_load_done.pop(req.request_id, None)
        req.status = RequestStatus.FINISHED_ABORTED
        error = ("the producer's KV for this request's media could not be used and the decode server has no media "
                 "to encode; send the request again")
        logger.error("request %s: %s", req.request_id, error)
        self.failed.append(EngineCoreOutput(req.request_id, [], "abort", extra={"error": error}))
        self._free_request(req)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Finish requests from outside (stop strings found by the detokenizer)."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            (self.running if req.status == RequestStatus.RUNNING else self.waiting).remove(req)
            req.status = status
            self._free_request(req)

    def _release_written_encoder_inputs(self, req: Request) -> None:
        for f in req.mm_features:
            if f.end <= req.num_computed_tokens:
                self.encoder_cache.free_encoder_input(req.request_id, f.mm_hash)

    def _free_blocks_and_encoder_refs(self, req: Request) -> None:
        self.kv.free(req)
        self.encoder_cache.free(req.request_id)

    def _free_request(self, req: Request) -> dict | None:
        """Free a finished request's blocks and encoder references, unless the connector keeps its blocks until
        they are sent (`kept_blocks`: freed when a worker lists the request in `finished_sending`, which a
        producer's worker does on the consumer's confirmation or a timeout). Returns the connector's
        kv_transfer_params for the client (or None)."""
        keep, params = False, None
        if self.connector is not None:
            block_ids = self.kv.get_block_ids(req.request_id)
            keep, params = self.connector.request_finished(req, block_ids[0] if block_ids else [])
        self.encoder_cache.free(req.request_id)
        if keep:
            self.kept_blocks[req.request_id] = req
        else:
            self.kv.free(req)
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]
        return params

    def _free_sent(self, request_ids) -> None:
        """The kept blocks of these finished requests were sent (or given up on): free them."""
        for rid in request_ids:
            req = self.kept_blocks.pop(rid, None)
            if req is not None:
                self.kv.free(req)

    # -- introspection ------------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_kv)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_kv)

    def kv_pool_gauges(self) -> dict[str, int]:
        """Leak gauges for /metrics (names without `vlserve:`): the KV pool's free and used blocks, the blocks and
        requests a producer keeps for a peer, and the requests waiting for remote / offloaded KV."""
        pool = self.kv.pool
        kept = sum(len(ids) for rid in self.kept_blocks for ids in self.kv.get_block_ids(rid))
        return {"kv_free_blocks": pool.num_free_blocks,
                "kv_used_blocks": pool.num_usable_blocks - pool.num_free_blocks,
                "kv_kept_blocks": kept, "kv_kept_requests": len(self.kept_blocks),
                "num_requests_waiting_for_kv": len(self.waiting_for_kv)}

    def check_integrity(self) -> None:
        """KV pool and encoder cache invariants; when idle, nothing may be held at all."""
        self.kv.check_integrity()
        self.encoder_cache.check_integrity()
        held = set(self.kv.req_to_blocks)
        assert set(self.kept_blocks) <= held, f"kept blocks not held: {set(self.kept_blocks) - held}"
        assert not set(self.kept_blocks) & set(self.requests), "a request both alive and kept for sending"
        if not self.has_unfinished_requests() and not self.kept_blocks:
            assert not self.kv.req_to_blocks, f"KV blocks leaked: {list(self.kv.req_to_blocks)}"
            assert self.kv.pool.num_free_blocks == self.kv.pool.num_usable_blocks, "KV blocks leaked"
        elif not self.has_unfinished_requests():
            assert held == set(self.kept_blocks), f"KV blocks leaked: {held - set(self.kept_blocks)}"
            assert not self.encoder_cache.req_to_hashes, (
                f"encoder cache entries still referenced: {list(self.encoder_cache.req_to_hashes)}")
