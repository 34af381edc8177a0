"""Bookkeeping for the encoder output cache (pure Python, no torch): which media items' embeddings the runner
holds, who still needs them, and which to drop when space runs out.

Space is counted in embeddings. An entry (one mm_hash) is *referenced* while some request still needs its
embeddings, and *freeable* once no request does: freeable entries stay cached (a later request with the same
media hits them) but count as reclaimable space and are evicted least-recently-released first, only when an
allocation actually needs the room (in allocate(); can_allocate() only asks). The runner learns of evictions from get_freed_mm_hashes() and drops the
tensors.

A *partial* entry is allocated but still being encoded a slice of its tower per step (`partial`: stages done). No
other request reuses it until it is complete, and once no request references it, it is dropped at once (not kept
as freeable): its space is freed and its mm_hash goes out with the evicted ones, so the runner drops its partial
state.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection


class EncoderCacheManager:
    """vLLM-v1-style encoder cache manager keyed by mm_hash; capacity `cache_size` embeddings."""

    def __init__(self, cache_size: int):
        if cache_size < 0:
            raise ValueError(f"encoder cache size must be >= 0, got {cache_size}")
        self.cache_size = cache_size
        self.num_free = cache_size  # not occupied by any entry
        self.num_freeable = cache_size  # num_free + space of unreferenced entries
        self.cached: dict[str, set[str]] = {}  # mm_hash -> ids of the requests referencing it
        self.num_embeds: dict[str, int] = {}  # mm_hash -> embeddings it occupies
        self.freeable: OrderedDict[str, int] = OrderedDict()  # unreferenced entries, least recently released first
        self.req_to_hashes: dict[str, set[str]] = {}  # request id -> mm_hashes it references
        self._freed: list[str] = []  # evicted (or abandoned partial) since the last get_freed_mm_hashes()
        self.partial: dict[str, int] = {}  # mm_hash -> stages done, for entries encoded over several steps
        self.hits = 0
        self.misses = 0
        self.hits_by_modality: dict[str, int] = {}  # only items whose modality the caller named
        self.misses_by_modality: dict[str, int] = {}
        self.evictions = 0

    # -- queries -----------------------------------------------------------------------------------------------
    def has(self, mm_hash: str) -> bool:
        """Whether the embeddings of this item are cached (referenced or freeable)."""
        return mm_hash in self.cached

    @property
    def num_used(self) -> int:
        """Embeddings occupied by cached entries (referenced or freeable)."""
        return self.cache_size - self.num_free

    @property
    def usage(self) -> float:
        """Fraction of the cache occupied by entries (freeable ones included)."""
        return self.num_used / self.cache_size if self.cache_size else 0.0

    # -- scheduling --------------------------------------------------------------------------------------------
    def check_and_update_cache(self, request_id: str, mm_hash: str, modality: str | None = None) -> bool:
        """If mm_hash is cached, make `request_id` reference it (so it is not evicted) and return True; a new
        reference counts as a hit (per modality too, when given)."""
        refs = self.cached.get(mm_hash)
        if refs is None:
            return False
        if not refs:  # freeable -> referenced again
            self.num_freeable -= self.freeable.pop(mm_hash)
        if request_id not in refs:
            refs.add(request_id)
            self.req_to_hashes.setdefault(request_id, set()).add(mm_hash)
            self.hits += 1
            if modality is not None:
                self.hits_by_modality[modality] = self.hits_by_modality.get(modality, 0) + 1
        return True

    def can_allocate(
        self,
        num_embeds: int,
        compute_budget_left: int | None = None,
        num_embeds_to_schedule: int = 0,
        reuse: Collection[str] = (),
    ) -> bool:
        """Whether an item of `num_embeds` embeddings can be encoded now and cached (a pure query).

        False if num_embeds exceeds `compute_budget_left` (the encoder budget left in this step, None = no limit)
        or if it plus `num_embeds_to_schedule` (items already chosen this step but not yet allocated) does not fit
        even after evicting every freeable entry other than those in `reuse` (cached items the caller is about
        to reference, which must not be evicted). Eviction itself happens in allocate().
        """
        if compute_budget_left is not None and num_embeds > compute_budget_left:
            return False
        need = num_embeds + num_embeds_to_schedule
        if need <= self.num_free:
            return True
        kept = sum(self.freeable.get(h, 0) for h in set(reuse))
        return need <= self.num_freeable - kept

    def allocate(self, request_id: str, mm_hash: str, num_embeds: int, modality: str | None = None) -> None:
        """Reserve space for the encoder output of a newly scheduled item, referenced by `request_id`, evicting
        the least recently released freeable entries (just enough of them) when the free space is short.

        Call after can_allocate() returned True. Allocating an mm_hash that is already cached only adds the
        reference.
        """
        if self.check_and_update_cache(request_id, mm_hash, modality):
            return
        if num_embeds > self.num_freeable:
            raise RuntimeError(
                f"encoder cache: allocating {num_embeds} embeddings for {mm_hash[:16]} but only "
                f"{self.num_freeable} are free or freeable; call can_allocate() first"
            )
        self._evict_until_free(num_embeds)
        self.cached[mm_hash] = {request_id}
        self.num_embeds[mm_hash] = num_embeds
        self.req_to_hashes.setdefault(request_id, set()).add(mm_hash)
        self.num_free -= num_embeds
        self.num_freeable -= num_embeds
        self.misses += 1
        if modality is not None:
            self.misses_by_modality[modality] = self.misses_by_modality.get(modality, 0) + 1

    def advance_partial(self, mm_hash: str, stages_done: int, num_stages: int) -> None:
        """Record that an allocated entry's first `stages_done` of `num_stages` stages are encoded (complete at
        num_stages: an ordinary entry from then on)."""
        if stages_done >= num_stages:
            self.partial.pop(mm_hash, None)
        else:
            self.partial[mm_hash] = stages_done

    def _evict_until_free(self, num_embeds: int) -> None:
        """Evict freeable entries, least recently released first, until num_embeds are free."""
        while num_embeds > self.num_free:
            mm_hash, _ = self.freeable.popitem(last=False)
            self._drop(mm_hash)
            self.evictions += 1

    def _drop(self, mm_hash: str) -> None:
        """Remove an unreferenced entry: its space is free, and the runner hears of it (get_freed_mm_hashes)."""
        del self.cached[mm_hash]
        self.num_free += self.num_embeds.pop(mm_hash)
        self._freed.append(mm_hash)

    def release_written(self, request_id: str, features, num_computed_tokens: int) -> None:
        """Drop the request's references to the items whose placeholder runs end within its computed tokens."""
        for f in features:
            if f.end <= num_computed_tokens:
                self.free_encoder_input(request_id, f.mm_hash)

    def free_encoder_input(self, request_id: str, mm_hash: str) -> None:
        """Drop one request's reference (its tokens for that item are in the KV cache now). The entry stays cached;
        once unreferenced it becomes freeable. No-op if the request holds no reference."""
        refs = self.cached.get(mm_hash)
        if refs is None or request_id not in refs:
            return
        refs.discard(request_id)
        hashes = self.req_to_hashes.get(request_id)
        if hashes is not None:
            hashes.discard(mm_hash)
            if not hashes:
                del self.req_to_hashes[request_id]
        if not refs:
            size = self.num_embeds[mm_hash]
            self.num_freeable += size
            if self.partial.pop(mm_hash, None) is not None:  # abandoned mid-encode: nobody can use it, drop it now
                self._drop(mm_hash)
            else:
                self.freeable[mm_hash] = size

    def free(self, request_id: str) -> None:
        """Drop every reference of a finished, aborted or preempted request."""
        for mm_hash in list(self.req_to_hashes.get(request_id, ())):
            self.free_encoder_input(request_id, mm_hash)

    def evict(self, mm_hashes) -> int:
        """Drop those of `mm_hashes` that are cached and unreferenced now (an owner that will not need them again,
        e.g. a closed video session); returns how many were dropped. Referenced entries stay."""
        dropped = 0
        for mm_hash in mm_hashes:
            if mm_hash in self.freeable:
                del self.freeable[mm_hash]
                self._drop(mm_hash)
                dropped += 1
        return dropped

    def get_freed_mm_hashes(self) -> list[str]:
        """mm_hashes evicted since the last call (the runner drops those tensors)."""
        freed, self._freed = self._freed, []
        return freed

    def reset(self) -> None:
        """Evict every unreferenced entry (e.g. on a cache reset); referenced entries stay."""
        self._evict_until_free(self.num_freeable)

    # -- checks ------------------------------------------------------------------------------------------------
    def check_integrity(self) -> bool:
        """Assert that used + free == size, free <= freeable accounting, and references are consistent."""
        used = sum(self.num_embeds.values())
        assert set(self.num_embeds) == set(self.cached), "entries without sizes or sizes without entries"
        assert used + self.num_free == self.cache_size, (
            f"encoder cache: used {used} + free {self.num_free} != size {self.cache_size}"
        )
        assert self.num_free >= 0, f"negative free space {self.num_free}"
        unreferenced = {h for h, refs in self.cached.items() if not refs}
        assert unreferenced == set(self.freeable), "freeable list != unreferenced entries"
        assert all(self.freeable[h] == self.num_embeds[h] for h in self.freeable), "freeable sizes differ"
        assert self.num_freeable == self.num_free + sum(self.freeable.values()), (
            f"freeable space {self.num_freeable} != free {self.num_free} + unreferenced {sum(self.freeable.values())}"
        )
        pairs = {(r, h) for h, refs in self.cached.items() for r in refs}
        pairs_from_reqs = {(r, h) for r, hashes in self.req_to_hashes.items() for h in hashes}
        assert pairs == pairs_from_reqs, "request -> mm_hash index disagrees with entry references"
        assert all(self.req_to_hashes.values()), "empty request entries kept"
        assert all(self.cached.get(h) for h in self.partial), "a partial entry absent or referenced by no request"
        return True
