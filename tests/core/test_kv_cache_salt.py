"""cache_salt in the prefix cache: the salt enters the first block's hash, so only requests with the same salt share
cached blocks (pure Python, no model)."""

from vlserve.core.kv_cache_manager import KVCacheManager, block_extra_keys
from vlserve.core.request import EngineCoreRequest, Request
from vlserve.sampling_params import SamplingParams


def make_req(rid, tokens, salt=None):
    engine_req = EngineCoreRequest(rid, list(tokens), SamplingParams(max_tokens=8), 0.0, cache_salt=salt)
    return Request(engine_req, 8)


def cached_prefix(kv, first, second):
    """Tokens of `second` served from what `first` cached (both prompts written in full first)."""
    kv.allocate_slots(first, first.num_tokens)
    hits, n = kv.get_computed_blocks(second)
    kv.allocate_slots(second, second.num_tokens - n, hits)
    kv.check_integrity()
    return n


def test_salt_enters_only_the_first_block_keys():
    req = make_req("a", range(12), salt="tenant-1")
    assert "salt:tenant-1" in block_extra_keys(req, 0, 4)
    assert not any(k.startswith("salt:") for k in block_extra_keys(req, 4, 8))
    assert block_extra_keys(make_req("b", range(12)), 0, 4) == ()


def test_different_salts_share_no_block_same_salt_shares():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    a = make_req("a", range(13), salt="tenant-1")
    b = make_req("b", range(13), salt="tenant-2")
    assert cached_prefix(kv, a, b) == 0
    held_a, held_b = kv.get_block_ids("a")[0], kv.get_block_ids("b")[0]
    assert not set(held_a) & set(held_b)
    assert [x != y for x, y in zip(a.block_hashes, b.block_hashes)] == [True, True, True]  # the chain carries it
    c = make_req("c", range(13), salt="tenant-1")
    hits, n = kv.get_computed_blocks(c)
    assert n == 12 and [blk.block_id for blk in hits[0]] == held_a[:3]


def test_salted_and_unsalted_do_not_share():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    assert cached_prefix(kv, make_req("a", range(9)), make_req("b", range(9), salt="s")) == 0
    assert cached_prefix(kv, make_req("c", range(9)), make_req("d", range(9))) == 8  # control: unsalted share
