"""Block pool of the paged KV cache: ref counts, an LRU free queue and the prefix-hash index (pure Python)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class KVBlock:
    """One physical KV block. `block_hash` is set once the block is full and registered for prefix reuse."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """Owns every block. Free blocks sit in an LRU queue (oldest first); a free block keeps its hash, so a later
    request can revive it as a prefix hit until it is handed out again (lazy eviction)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, reserve_null_block: bool = False):
        if num_blocks < 1 + reserve_null_block:
            raise ValueError(f"the KV cache needs at least {1 + reserve_null_block} blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}  # block hash -> block holding those tokens
        # Block 0 as a placeholder in block tables where a sliding window dropped a block: never handed out, never
        # written, never freed (None when no group drops blocks).
        self.null_block: KVBlock | None = None
        if reserve_null_block:
            self.null_block = self._free.pop(0)
            self.null_block.ref_cnt = 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold (all but the null block)."""
        return self.num_blocks - (self.null_block is not None)

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n blocks from the head of the free queue (least recently freed first), evicting their hashes."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict_hash(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found by a prefix hit (reviving them from the free queue if needed)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the tail of the free queue in the
        order given (callers pass a request's blocks tail-first so its last blocks are evicted first)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    # Uncached blocks are the best eviction victims: put them at the head.
                    self._free[block.block_id] = block
                    self._free.move_to_end(block.block_id, last=False)
                else:
                    self._free[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: int) -> None:
        """Register a full block under its chained hash (first writer wins on duplicates)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self._cached.setdefault(block_hash, block)

    def _evict_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if len(self._free) != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True

    def check_integrity(self) -> None:
        """free + in use == total; free blocks have ref 0; the hash index points at blocks with that hash."""
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert in_use + len(self._free) == self.num_blocks, (in_use, len(self._free), self.num_blocks)
        for bid, block in self._free.items():
            assert block.ref_cnt == 0 and block.block_id == bid, block
        for h, block in self._cached.items():
            assert block.block_hash == h, (h, block)
