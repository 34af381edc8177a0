"""The scheduler's read-only side: whether requests remain, the KV pool's leak gauges and the integrity checks."""

from __future__ import annotations


class SchedulerIntrospection:
    """Mixed into `Scheduler` (reads its queues, KV cache manager, encoder cache and KV connector state)."""

    def has_unfinished_requests(self) -> bool:
        """Whether a request waits, runs or waits for its KV load."""
        return bool(self.waiting or self.running or self.kv_transfer.waiting_for_kv)

    def get_num_unfinished_requests(self) -> int:
        """How many requests wait, run or wait for their KV load."""
        return len(self.waiting) + len(self.running) + len(self.kv_transfer.waiting_for_kv)

    def kv_pool_gauges(self) -> dict[str, int]:
        """Leak gauges for /metrics (names without `vlserve:`): the KV pool's free and used blocks, the blocks and
        requests a producer keeps for a peer, and the requests waiting for remote / offloaded KV."""
        pool = self.kv.pool
        return {
            "kv_free_blocks": pool.num_free_blocks,
            "kv_used_blocks": pool.num_usable_blocks - pool.num_free_blocks,
            **self.kv_transfer.gauges(self.kv),
        }

    def check_integrity(self) -> None:
        """KV pool and encoder cache invariants; when idle, nothing may be held at all."""
        self.kv.check_integrity()
        self.encoder_cache.check_integrity()
        held, kept = set(self.kv.req_to_blocks), set(self.kv_transfer.kept_blocks)
        self.kv_transfer.check_integrity(held, self.requests)
        if not self.has_unfinished_requests() and not kept:
            assert not self.kv.req_to_blocks, f"KV blocks leaked: {list(self.kv.req_to_blocks)}"
            assert self.kv.pool.num_free_blocks == self.kv.pool.num_usable_blocks, "KV blocks leaked"
        elif not self.has_unfinished_requests():
            assert held == kept, f"KV blocks leaked: {held - kept}"
            assert not self.encoder_cache.req_to_hashes, (
                f"encoder cache entries still referenced: {list(self.encoder_cache.req_to_hashes)}"
            )
