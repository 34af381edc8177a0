"""EncoderCacheManager.evict: an owner drops the entries it will not need again, referenced ones stay."""

from __future__ import annotations

from vlserve.core.encoder_cache_manager import EncoderCacheManager


def test_evict_drops_only_unreferenced_entries():
    cache = EncoderCacheManager(100)
    cache.allocate("r1", "a", 10)
    cache.allocate("r1", "b", 20)
    cache.allocate("r2", "c", 30)
    cache.free("r1")  # a and b: cached, unreferenced
    assert cache.num_used == 60
    assert cache.evict(["a", "c", "missing"]) == 1  # c is still referenced by r2
    assert not cache.has("a") and cache.has("b") and cache.has("c")
    assert cache.num_used == 50 and cache.get_freed_mm_hashes() == ["a"]
    cache.check_integrity()
    cache.free("r2")
    assert cache.evict(["b", "c"]) == 2 and cache.num_used == 0
    assert sorted(cache.get_freed_mm_hashes()) == ["b", "c"]
    cache.check_integrity()
