"""Paged KV cache manager: block tables per request and prefix caching over chained block hashes (pure Python).

A model may keep several KV cache groups (core/kv_cache_groups.py: Gemma 3's full and sliding-window layers). Each
request then holds one block list per group, all of the same length (block i of every list covers tokens
i*bs .. (i+1)*bs - 1), drawn from one pool. A sliding-window group past group 0 replaces the blocks that left its
window by the pool's null block and hands them back; its prefix hits need only the blocks inside the window.
"""

from __future__ import annotations

from vlserve.core.block_pool import BlockPool, KVBlock
from vlserve.core.request import Request

GroupBlocks = tuple[list[KVBlock], ...]  # one list per KV cache group
GroupBlockIds = tuple[list[int], ...]  # the same as block ids; () when a step adds no block


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_extra_keys(request: Request, start: int, end: int) -> tuple[str, ...]:
    """What besides its tokens tells apart the KV of tokens start..end-1: the mm_hash of every media item
    overlapping them, "lora:<lora_int_id>" for a request run with a LoRA adapter, and "salt:<cache_salt>" for the
    first block of a salted request (the chain carries it into every later block, as vLLM does)."""
    extra = tuple(f.mm_hash for f in request.mm_features if f.offset < end and f.offset + f.length > start)
    lora_id = request.lora_int_id
    if lora_id:  # an adapter's KV is its own: never shared with the base or another adapter
        extra += (f"lora:{lora_id}",)
    if start == 0 and request.cache_salt:  # tenants with different salts never share a prefix
        extra += (f"salt:{request.cache_salt}",)
    return extra


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...], extra_keys: tuple[str, ...]) -> int:
    """Chained hash of one full block: the parent's hash, its tokens and its `block_extra_keys`."""
    return hash((parent_hash, token_ids, extra_keys))


class KVCacheManager:
    """Allocates blocks for requests, finds prefix hits, and frees blocks (lazily cached for reuse).

    `group_windows[g]`: KV cache group g's sliding window, None for full attention (default: one full group)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        group_windows: tuple[int | None, ...] = (None,),
    ):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        # groups that hand back out-of-window blocks (group 0 never does: the draft reads its table)
        self._dropping = [g for g in range(1, self.num_groups) if self.group_windows[g] is not None]
        self.pool = BlockPool(num_blocks, enable_caching, reserve_null_block=bool(self._dropping))
        self.req_to_blocks: dict[str, GroupBlocks] = {}
        self._num_cached_blocks: dict[str, list[int]] = {}  # per request, per group: leading blocks registered
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks in use."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_usable_blocks

    def max_request_tokens(self, max_chunk_tokens: int) -> int:
        """The most tokens one request can hold when alone in the pool, prefilled in chunks of at most
        `max_chunk_tokens`: every full group holds all its blocks, a dropping group its window plus one chunk."""
        bs, usable = self.block_size, self.pool.num_usable_blocks
        capped = [cdiv(self.group_windows[g] + max_chunk_tokens, bs) + 1 for g in self._dropping]
        num_full = self.num_groups - len(capped)
        lo, hi = 0, usable * bs  # the largest n whose blocks fit: sum_g min(cdiv(n, bs), cap_g) <= usable
        while lo < hi:
            mid = (lo + hi + 1) // 2
            need = num_full * cdiv(mid, bs) + sum(min(cdiv(mid, bs), c) for c in capped)
            lo, hi = (mid, hi) if need <= usable else (lo, mid - 1)
        return lo

    # -- hashing ---------------------------------------------------------------------------------------------
    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend request.block_hashes to cover every full block within the first num_tokens known tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        num_full = min(num_tokens, request.num_tokens) // bs
        plain = not (request.mm_features or request.lora_request or request.cache_salt)  # (no extra keys)
        tokens = request.all_token_ids
        while len(hashes) < num_full:
            i = len(hashes)
            start, end = i * bs, (i + 1) * bs
            extra = () if plain else block_extra_keys(request, start, end)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tuple(tokens[start:end]), extra))

    @staticmethod
    def _group_key(group: int, block_hash: int) -> int:
        """The pool's key of a block of `group` (groups never share a block: each group's pages differ)."""
        return block_hash if group == 0 else hash((group, block_hash))

    def _cached(self, group: int, block_hash: int) -> KVBlock | None:
        return self.pool.get_cached_block(self._group_key(group, block_hash))

    def _first_in_window(self, group: int, num_tokens: int) -> int:
        """The first block a query at position `num_tokens` still reads in `group` (0 unless it drops blocks)."""
        if group not in self._dropping:
            return 0
        return max(0, num_tokens - self.group_windows[group] + 1) // self.block_size

    # -- protocol --------------------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks | None, int]:
        """The longest cached prefix every group can serve (always leaves >= 1 token to compute): per group its
        blocks (the null block below a dropping group's window), and the number of tokens they hold. A request asking
        for prompt_logprobs reads no hit: every prompt token's logits are computed."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return None, 0
        max_hit_tokens = request.num_tokens - 1
        self._update_block_hashes(request, max_hit_tokens)
        hashes = request.block_hashes[: max_hit_tokens // self.block_size]
        n = 0
        while n < len(hashes) and all(
            self._cached(g, hashes[n]) is not None for g in range(self.num_groups) if g not in self._dropping
        ):
            n += 1
        changed = bool(self._dropping)
        while changed and n:  # the groups' answers shrink n until all agree
            changed = False
            for g in self._dropping:
                m = self._window_hit(g, hashes, n)
                if m < n:
                    n, changed = m, True
        self.prefix_queries += request.num_tokens
        self.prefix_hits += n * self.block_size
        if n == 0:
            return None, 0
        null = self.pool.null_block
        hits = tuple(
            [null] * (first := self._first_in_window(g, n * self.block_size))
            + [self._cached(g, h) for h in hashes[first:n]]
            for g in range(self.num_groups)
        )
        return hits, n * self.block_size

    def _window_hit(self, group: int, hashes: list[int], n: int) -> int:
        """The largest m <= n whose window blocks (those a query at position m * bs reads) are all cached."""
        m = n
        while m > 0:
            first = self._first_in_window(group, m * self.block_size)
            j = m - 1
            while j >= first and self._cached(group, hashes[j]) is not None:
                j -= 1
            if j < first:
                return m
            m = j  # block j is missing: a hit must end at or before it
        return 0

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: GroupBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> GroupBlockIds | None:
        """Make room for num_new_tokens (+ lookahead) after the request's computed tokens.

        Returns the ids of newly added blocks per group (`()` when none), or None when the pool cannot afford
        them; then nothing is changed. Full blocks whose tokens are known are registered for prefix reuse right
        away: their KV is written in this very step, before any later request in the step can read it. A
        dropping group first hands back the blocks that left its window. `delay_cache_blocks`: register nothing
        now (a KV connector loads those blocks later; the request's next allocation registers them).
        """
        if not new_computed_blocks:  # the common decode step: room left in the last block, no block to register
            known = request.num_computed_tokens + num_new_tokens
            if 0 < known + num_lookahead_tokens <= request.kv_token_capacity:
                if known <= request.kv_registered_limit:
                    return ()
                if not self._dropping and not delay_cache_blocks:  # room left, but a block just filled: register it
                    self._register_full_blocks(request, self.req_to_blocks[request.request_id], known)
                    return ()
        bs = self.block_size
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        num_hit = len(new_computed_blocks[0]) if new_computed_blocks else 0
        num_computed = request.num_computed_tokens + num_hit * bs
        if blocks is not None and self._dropping:  # less the lookahead: rejected drafts may move the window back
            self._drop_out_of_window(blocks, num_computed - num_lookahead_tokens)
        held = len(blocks[0]) if blocks is not None else 0
        num_needed = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, bs) - held - num_hit
        revived = 0
        if new_computed_blocks:
            revived = sum(1 for group in new_computed_blocks for b in group if b.ref_cnt == 0)
        if max(num_needed, 0) * self.num_groups + revived > self.pool.num_free_blocks:
            return None
        if blocks is None:
            blocks = self.req_to_blocks[rid] = tuple([] for _ in range(self.num_groups))
            self._num_cached_blocks[rid] = [0] * self.num_groups
        new_ids = []
        for g, group_blocks in enumerate(blocks):
            if new_computed_blocks:
                self.pool.touch(b for b in new_computed_blocks[g] if b is not self.pool.null_block)
                group_blocks.extend(new_computed_blocks[g])
            new = self.pool.get_new_blocks(max(num_needed, 0))
            group_blocks.extend(new)
            new_ids.append([b.block_id for b in new])
        request.kv_token_capacity = len(blocks[0]) * bs
        if self.enable_caching and not delay_cache_blocks:
            if new_computed_blocks or num_computed + num_new_tokens > request.kv_registered_limit:  # (else none filled)
                self._register_full_blocks(request, blocks, num_computed + num_new_tokens)
        else:
            request.kv_registered_limit = (
                (self._num_cached_blocks[rid][0] + 1) * bs - 1 if self.enable_caching else request.kv_token_capacity
            )
        return tuple(new_ids) if any(new_ids) else ()

    def _drop_out_of_window(self, blocks: GroupBlocks, num_computed: int) -> None:
        """Hand back each dropping group's blocks that no query from position `num_computed` on reads."""
        null = self.pool.null_block
        for g in self._dropping:
            group_blocks = blocks[g]
            # the dropped blocks are always a leading run: walk back from the window's edge to the last one dropped
            i = min(self._first_in_window(g, num_computed), len(group_blocks)) - 1
            gone = []
            while i >= 0 and group_blocks[i] is not null:
                gone.append(group_blocks[i])
                group_blocks[i] = null
                i -= 1
            if gone:
                self.pool.free_blocks(gone)  # the block nearest the window first, as before

    def _register_full_blocks(self, request: Request, blocks: GroupBlocks, num_tokens: int) -> None:
        """Register for prefix reuse every full block within the first `num_tokens` known tokens, and set the
        position past which the request's next block fills (`kv_registered_limit`)."""
        self._update_block_hashes(request, num_tokens)
        counts = self._num_cached_blocks[request.request_id]
        end = min(len(request.block_hashes), num_tokens // self.block_size)
        null = self.pool.null_block
        for g, group_blocks in enumerate(blocks):
            for i in range(counts[g], end):
                if group_blocks[i] is not null:
                    self.pool.cache_block(group_blocks[i], self._group_key(g, request.block_hashes[i]))
            counts[g] = max(counts[g], end)
        request.kv_registered_limit = (counts[0] + 1) * self.block_size - 1

    def free(self, request: Request) -> None:
        """Release all of a request's blocks (tail first, so its last blocks are the first evicted)."""
        blocks = self.req_to_blocks.pop(request.request_id, ())
        self._num_cached_blocks.pop(request.request_id, None)
        request.kv_token_capacity, request.kv_registered_limit = 0, -1
        null = self.pool.null_block
        for group_blocks in blocks:
            self.pool.free_blocks(b for b in reversed(group_blocks) if b is not null)

    def get_block_ids(self, request_id: str) -> GroupBlockIds:
        """The request's block ids per group (the null block's id, 0, where a window dropped one)."""
        return tuple([b.block_id for b in group] for group in self.req_to_blocks.get(request_id, ()))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants plus: every block held by a request has a ref count >= the number of holders, and every
        group of a request holds as many block-table entries as the others."""
        self.pool.check_integrity()
        holders: dict[int, int] = {}
        null = self.pool.null_block
        for blocks in self.req_to_blocks.values():
            assert len({len(group) for group in blocks}) == 1, [len(group) for group in blocks]
            for group in blocks:
                for b in group:
                    if b is not null:
                        holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for bid, n in holders.items():
            assert self.pool.blocks[bid].ref_cnt == n, (bid, self.pool.blocks[bid].ref_cnt, n)
        for b in self.pool.blocks:
            if b.block_id not in holders and b is not null:
                assert b.ref_cnt == 0, f"leaked {b}"
