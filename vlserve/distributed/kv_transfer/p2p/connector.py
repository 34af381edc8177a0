"""P2PConnector: disaggregated prefill / decode between two engines over Mooncake's Transfer Engine (the shape of
vLLM's NixlConnector / MooncakeConnector: the consumer pulls).

Producer (prefill engine, kv_producer): a request sent with kv_transfer_params {"do_remote_decode": true} (and
usually max_tokens=1) keeps its blocks when it ends (`request_finished` -> keep); its last output carries
kv_transfer_params {do_remote_prefill, remote_host, remote_port (the producer worker's side channel),
remote_engine_id, remote_request_id, remote_block_ids, remote_num_tokens}. The producer's worker frees them (reports
`finished_sending`) when the consumer says it is done reading, or after `send_timeout_s` (default 120 s).

Consumer (decode engine, kv_consumer): a request carrying those params (same prompt) gets blocks for the prompt
tokens past its own device hit except the last one, waits (`waiting_for_kv`; other requests keep stepping) while
its worker reads the producer's blocks in a background thread (one batched Mooncake read), then computes the last
prompt token (its logits) and decodes on. A failed read falls back to recomputing; params that do not match the
prompt are ignored (recompute), and the producer is told to free its blocks in every case.

extra config: side_channel_host (default 127.0.0.1: also the address Mooncake binds), side_channel_port (a
producer's; the engine picks a free one when absent, `_side_channel_port`), send_timeout_s, and `_engine_id`.
Limits: one rank per engine, one KV cache group, the two engines must share model, KV dtype and block size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from vlserve.distributed.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from vlserve.multimodal.inputs import feature_to_remote

logger = logging.getLogger(__name__)


@dataclass
class P2PLoad:
    host: str
    port: int
    remote_request_id: str
    remote_block_ids: list[int]  # empty: nothing to read, only tell the producer to free its blocks
    local_block_ids: list[int]
    remote_engine_id: str = ""  # the producer's run: a restarted producer on the same port is described anew


@dataclass
class P2PMetadata(KVConnectorMetadata):
    loads: dict[str, P2PLoad] = field(default_factory=dict)  # request -> what its worker reads
    new_sends: list[str] = field(default_factory=list)  # producer: requests whose blocks are now kept for a peer


class P2PConnector(KVConnectorBase):
    def __init__(self, config, role: KVConnectorRole, block_size: int = 16, **context):
        super().__init__(config, role, block_size=block_size, **context)
        extra = config.kv_connector_extra_config
        self.block_size = block_size
        self.host = extra.get("side_channel_host", "127.0.0.1")
        port = extra.get("side_channel_port", extra.get("_side_channel_port"))
        self.port = None if port is None else int(port)
        if config.is_producer and self.port is None:
            raise ValueError("a P2P producer needs side_channel_port (the engine fills it in)")
        self.engine_id = str(extra.get("_engine_id", ""))
        self.send_timeout_s = float(extra.get("send_timeout_s", 120.0))
        self.worker = None
        if role == KVConnectorRole.WORKER:
            from vlserve.distributed.kv_transfer.p2p.worker import P2PWorker  # torch / Mooncake: workers only

            self.worker = P2PWorker(self.host, self.port if config.is_producer else None, self.send_timeout_s)
            return
        self._loads: dict[str, P2PLoad] = {}  # planned this step
        self._new_sends: list[str] = []
        self._loading: set[str] = set()  # planned loads not reported yet
        self._abandoned: set[str] = set()  # finished while loading: blocks kept until the read ends
        self._done_with_params: set[str] = set()  # consumer requests whose params were acted on
        # loads: blocks read, requests read / failed (recomputed); sends: requests kept for a consumer, freed on
        # its confirmation, freed after send_timeout_s without one
        self.counters = {
            "kv_p2p_loaded_blocks_total": 0,
            "kv_p2p_loads_done_total": 0,
            "kv_p2p_failed_loads_total": 0,
            "kv_p2p_kept_requests_total": 0,
            "kv_p2p_sends_confirmed_total": 0,
            "kv_p2p_send_timeouts_total": 0,
        }

    # -- scheduler side ----------------------------------------------------------------------------------------
    def _remote(self, request) -> dict | None:
        p = request.kv_transfer_params
        if not self.config.is_consumer or not p or not p.get("do_remote_prefill"):
            return None
        if request.request_id in self._done_with_params:
            return None
        return p

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        p = self._remote(request)
        if p is None:
            return 0, False
        n_prompt = len(request.prompt_token_ids)
        n_load = n_prompt - 1 - num_computed_tokens  # the last prompt token is computed here (its logits)
        usable = int(p.get("remote_num_tokens", -1)) == n_prompt and len(p.get("remote_block_ids", ())) >= -(
            -n_prompt // self.block_size
        )
        if n_load > 0 and usable:
            return n_load, True
        if not usable:
            logger.warning("request %s: kv_transfer_params do not match its prompt; recomputing", request.request_id)
        self._plan(request, p, [], [])  # nothing to read: only let the producer free its blocks
        return 0, False

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        p = self._remote(request)
        if p is None or num_external_tokens == 0:
            return
        first = request.num_computed_tokens // self.block_size  # the device hit is whole blocks
        last = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
        self._plan(request, p, list(p["remote_block_ids"][first:last]), list(block_ids[first:last]))
        self._loading.add(request.request_id)

    def _plan(self, request, p: dict, remote: list[int], local: list[int]) -> None:
        self._done_with_params.add(request.request_id)
        self._loads[request.request_id] = P2PLoad(
            str(p["remote_host"]),
            int(p["remote_port"]),
            str(p["remote_request_id"]),
            remote,
            local,
            str(p.get("remote_engine_id", "")),
        )

    def build_connector_meta(self, scheduler_output, scheduler) -> KVConnectorMetadata | None:
        if not (self._loads or self._new_sends or self._loading or scheduler.kv_transfer.kept_blocks):
            return None
        # (empty metadata while loads are in flight or blocks are kept: the worker must be asked what ended)
        meta = P2PMetadata(self._loads, self._new_sends)
        self._loads, self._new_sends = {}, []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_recving:
            self._loading.discard(rid)
            if rid in output.failed_recving:
                self.counters["kv_p2p_failed_loads_total"] += 1
            if rid in self._abandoned:  # ended while its read ran: its blocks can go now
                self._abandoned.discard(rid)
                output.finished_sending.add(rid)
        for stat in ("loaded_blocks", "loads_done", "sends_confirmed", "send_timeouts"):
            self.counters[f"kv_p2p_{stat}_total"] += output.stats.get(stat, 0)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        if rid in self._loading:  # aborted while its read runs into these blocks: keep them until it ends
            self._abandoned.add(rid)
            return True, None
        self._done_with_params.discard(rid)
        p = request.kv_transfer_params
        if (
            not (self.config.is_producer and p and p.get("do_remote_decode"))
            or not request.status.is_finished
            or request.status.finish_reason == "abort"
            or not block_ids
        ):
            return False, None
        n_prompt = len(request.prompt_token_ids)
        self._new_sends.append(rid)
        self.counters["kv_p2p_kept_requests_total"] += 1
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": rid,
            "remote_block_ids": list(block_ids[: -(-n_prompt // self.block_size)]),
            "remote_num_tokens": n_prompt,
        }
        if request.mm_features:  # the consumer takes the expanded prompt and media-less items, never the media
            params["remote_prompt_token_ids"] = list(request.prompt_token_ids)
            params["remote_mm_features"] = [feature_to_remote(f) for f in request.mm_features]
        return True, params

    def stats(self) -> dict[str, int]:
        return dict(self.counters)

    # -- worker side -------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches, draft_kv_cache=None) -> None:
        self.worker.register_kv_caches(kv_caches, draft_kv_cache)

    def start_load_kv(self, metadata) -> None:
        if metadata is not None:
            self.worker.start(metadata)

    def get_finished(self) -> KVConnectorOutput | None:
        return self.worker.get_finished()
