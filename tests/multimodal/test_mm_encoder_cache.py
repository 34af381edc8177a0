"""EncoderCacheManager: hits, misses, lazy LRU eviction of unreferenced entries, integrity."""

from __future__ import annotations

import random
import sys

import pytest

from vlserve.core.encoder_cache_manager import EncoderCacheManager


def test_no_torch_import():
    import subprocess
    from pathlib import Path

    code = "import sys, vlserve.core.encoder_cache_manager; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_miss_allocate_hit_and_free():
    m = EncoderCacheManager(100)
    assert not m.check_and_update_cache("r1", "A")
    assert m.can_allocate(40, compute_budget_left=50)
    m.allocate("r1", "A", 40)
    assert m.num_free == 60 and m.usage == pytest.approx(0.4) and m.misses == 1
    assert m.check_and_update_cache("r2", "A") and m.hits == 1
    assert m.check_and_update_cache("r2", "A") and m.hits == 1  # the same request again: no new hit
    m.free_encoder_input("r1", "A")
    m.free_encoder_input("r1", "A")  # idempotent
    assert m.cached["A"] == {"r2"} and not m.freeable
    m.free("r2")
    assert m.has("A") and list(m.freeable) == ["A"] and m.num_free == 60 and m.num_freeable == 100
    # Freeable entries are still hits and become referenced (unfreeable) again.
    assert m.check_and_update_cache("r3", "A")
    assert not m.freeable and m.num_freeable == 60
    m.check_integrity()


def test_compute_budget_and_capacity():
    m = EncoderCacheManager(100)
    assert not m.can_allocate(30, compute_budget_left=29)
    assert m.can_allocate(100, compute_budget_left=None)
    assert not m.can_allocate(101)
    m.allocate("r1", "A", 70)
    assert m.can_allocate(20, num_embeds_to_schedule=10)
    assert not m.can_allocate(20, num_embeds_to_schedule=11)
    with pytest.raises(RuntimeError, match="can_allocate"):
        m.allocate("r2", "B", 31)
    m.free("r1")  # A freeable: space for B only by evicting A, unless A is about to be reused
    assert m.can_allocate(31) and not m.can_allocate(31, reuse=["A"]) and m.can_allocate(30, reuse=["A", "A"])
    m.check_integrity()


def test_lru_eviction_only_under_pressure():
    m = EncoderCacheManager(100)
    for i, h in enumerate("ABCD"):
        m.allocate(f"r{i}", h, 25)
    for i, h in enumerate("ABCD"):
        if h != "C":
            m.free_encoder_input(f"r{i}", h)  # release order: A, B, D; C stays referenced
    assert m.num_free == 0 and m.num_freeable == 75
    assert m.get_freed_mm_hashes() == []  # nothing evicted while there is no pressure
    assert m.can_allocate(30) and m.can_allocate(30)  # a pure query: it evicts nothing
    assert m.get_freed_mm_hashes() == [] and m.has("A") and m.evictions == 0
    m.allocate("r9", "E", 30)  # needs 30: evicts A (25) then B (25), least recently released first
    assert m.get_freed_mm_hashes() == ["A", "B"] and m.get_freed_mm_hashes() == []
    assert m.evictions == 2 and not m.has("A") and m.has("D") and m.has("C")
    assert not m.can_allocate(46)  # free 20 + freeable D 25 = 45 < 46; C is referenced and never evicted
    assert m.has("D") and m.get_freed_mm_hashes() == []
    m.check_integrity()


def test_hit_refreshes_lru_order():
    m = EncoderCacheManager(50)
    m.allocate("r1", "A", 25)
    m.allocate("r2", "B", 25)
    m.free("r1")
    m.free("r2")  # release order A, B
    assert m.check_and_update_cache("r3", "A")
    m.free("r3")  # now B was released before A
    m.allocate("r4", "C", 10)
    assert m.get_freed_mm_hashes() == ["B"]


def test_allocate_of_cached_hash_only_adds_ref():
    m = EncoderCacheManager(40)
    m.allocate("r1", "A", 30)
    m.allocate("r2", "A", 30)  # e.g. two requests with the same image in one step
    assert m.num_free == 10 and m.cached["A"] == {"r1", "r2"}
    m.free("r1")
    assert not m.freeable
    m.free("r2")
    assert list(m.freeable) == ["A"]
    m.reset()
    assert m.get_freed_mm_hashes() == ["A"] and m.num_free == 40
    m.check_integrity()


def test_integrity_detects_corruption():
    m = EncoderCacheManager(10)
    m.allocate("r1", "A", 5)
    m.num_free += 1
    with pytest.raises(AssertionError, match="used"):
        m.check_integrity()


def test_random_workload_keeps_integrity():
    rng = random.Random(0)
    m = EncoderCacheManager(200)
    live: dict[str, set[str]] = {}
    sizes = {f"h{i}": rng.randint(5, 60) for i in range(30)}
    for _step in range(2000):
        rid = f"r{rng.randint(0, 15)}"
        h = rng.choice(list(sizes))
        op = rng.random()
        if op < 0.5:
            if not m.check_and_update_cache(rid, h):
                if m.can_allocate(sizes[h], compute_budget_left=100):
                    m.allocate(rid, h, sizes[h])
                else:
                    continue
            live.setdefault(rid, set()).add(h)
        elif op < 0.8 and live.get(rid):
            h = rng.choice(sorted(live[rid]))
            m.free_encoder_input(rid, h)
            live[rid].discard(h)
        else:
            m.free(rid)
            live.pop(rid, None)
        for freed in m.get_freed_mm_hashes():
            assert all(freed not in hs for hs in live.values()), "evicted an entry still referenced"
        m.check_integrity()
        referenced = sum(sizes[h] for h in {h for hs in live.values() for h in hs})
        assert m.cache_size - m.num_freeable == referenced
    assert m.hits > 0 and m.misses > 0 and m.evictions > 0
