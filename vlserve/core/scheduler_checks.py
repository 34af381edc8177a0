"""What the scheduler reports about its components for /metrics and for tests: the KV pool's leak gauges and the
integrity checks across the KV cache manager, the encoder cache and the KV connector's scheduler side."""

from __future__ import annotations

from vlserve.core.encoder_cache_manager import EncoderCacheManager
from vlserve.core.kv_cache_manager import KVCacheManager
from vlserve.core.kv_connector_sched import KVConnectorState


def kv_pool_gauges(kv: KVCacheManager, kv_transfer: KVConnectorState) -> dict[str, int]:
    """Leak gauges for /metrics (names without `vlserve:`): the KV pool's free and used blocks, the blocks and
    requests a producer keeps for a peer, and the requests waiting for remote / offloaded KV."""
    pool = kv.pool
    return {
        "kv_free_blocks": pool.num_free_blocks,
        "kv_used_blocks": pool.num_usable_blocks - pool.num_free_blocks,
        **kv_transfer.gauges(kv),
    }


def check_components(
    kv: KVCacheManager,
    encoder_cache: EncoderCacheManager,
    kv_transfer: KVConnectorState,
    requests: dict,
    busy: bool,
) -> None:
    """KV pool and encoder cache invariants; when not `busy` (no request waits or runs), nothing may be held but
    the blocks the connector keeps for a peer."""
    kv.check_integrity()
    encoder_cache.check_integrity()
    held, kept = set(kv.req_to_blocks), set(kv_transfer.kept_blocks)
    kv_transfer.check_integrity(held, requests)
    if not busy and not kept:
        assert not kv.req_to_blocks, f"KV blocks leaked: {list(kv.req_to_blocks)}"
        assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks, "KV blocks leaked"
    elif not busy:
        assert held == kept, f"KV blocks leaked: {held - kept}"
        assert not encoder_cache.req_to_hashes, (
            f"encoder cache entries still referenced: {list(encoder_cache.req_to_hashes)}"
        )
