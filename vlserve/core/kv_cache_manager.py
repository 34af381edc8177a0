"""Paged KV cache manager: block tables per request and prefix caching over chained block hashes (pure Python)."""
from __future__ import annotations

from vlserve.core.block_pool import BlockPool, KVBlock
from vlserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...], extra_keys: tuple[str, ...]) -> int:
    """Chained hash of one full block: the parent's hash, its tokens and the mm_hash of every overlapping item."""
    return hash((parent_hash, token_ids, extra_keys))


class KVCacheManager:
    """Allocates blocks for requests, finds prefix hits, and frees blocks (lazily cached for reuse)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # per request: leading blocks already hashed/registered
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    # -- hashing ---------------------------------------------------------------------------------------------
    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend request.block_hashes to cover every full block within the first num_tokens known tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        feats = request.mm_features
        num_full = min(num_tokens, request.num_tokens) // bs
        while len(hashes) < num_full:
            i = len(hashes)
            start, end = i * bs, (i + 1) * bs
            extra = tuple(f.mm_hash for f in feats if f.offset < end and f.offset + f.length > start)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tuple(request.all_token_ids[start:end]), extra))

    # -- protocol --------------------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks at the start of the request (always leaves >= 1 token to compute)."""
        if not self.enable_caching:
            return [], 0
        max_hit_tokens = request.num_tokens - 1
        self._update_block_hashes(request, max_hit_tokens)
        hits: list[KVBlock] = []
        for h in request.block_hashes[: max_hit_tokens // self.block_size]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Make room for num_new_tokens (+ lookahead) after the request's computed tokens.

        Returns the ids of newly added blocks (possibly empty), or None when the pool cannot afford them; then
        nothing is changed. Full blocks whose tokens are known are registered for prefix reuse right away: their
        KV is written in this very step, before any later request in the step can read it.
        """
        if not new_computed_blocks:  # the common decode step: room left in the last block, nothing to register
            blocks = self.req_to_blocks.get(request.request_id)
            if blocks is not None:
                bs = self.block_size
                known = request.num_computed_tokens + num_new_tokens
                if (-(-(known + num_lookahead_tokens) // bs) <= len(blocks)
                        and (not self.enable_caching
                             or known // bs <= self._num_cached_blocks.get(request.request_id, 0))):
                    return []
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens + num_lookahead_tokens
        num_needed = cdiv(total_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed + revived > self.pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return [b.block_id for b in new_blocks]

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        self._update_block_hashes(request, num_tokens)
        rid = request.request_id
        start = self._num_cached_blocks.get(rid, 0)
        end = min(len(request.block_hashes), num_tokens // self.block_size)
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[rid] = max(start, end)

    def free(self, request: Request) -> None:
        """Release all of a request's blocks (tail first, so its last blocks are the first evicted)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants plus: every block held by a request has a ref count >= the number of holders."""
        self.pool.check_integrity()
        holders: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for bid, n in holders.items():
            assert self.pool.blocks[bid].ref_cnt == n, (bid, self.pool.blocks[bid].ref_cnt, n)
        for b in self.pool.blocks:
            if b.block_id not in holders:
                assert b.ref_cnt == 0, f"leaked {b}"
