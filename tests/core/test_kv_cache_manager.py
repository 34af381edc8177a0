"""KV cache manager and block pool: allocation, prefix hits, LRU reuse, media-aware hashes, integrity."""

import pytest

from vlserve.core.block_pool import BlockPool
from vlserve.core.kv_cache_manager import KVCacheManager
from vlserve.core.request import EngineCoreRequest, Request
from vlserve.multimodal.inputs import MultiModalFeature
from vlserve.sampling_params import SamplingParams


def make_req(rid, tokens, mm=None):
    return Request(EngineCoreRequest(rid, list(tokens), SamplingParams(max_tokens=8), 0.0, mm or []), 8)


def test_pool_allocate_free_integrity():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert pool.num_free_blocks == 1
    pool.check_integrity()
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == 4
    pool.check_integrity()
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)


def test_allocate_grows_block_table_and_refuses_when_full():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = make_req("a", range(10))
    assert kv.allocate_slots(req, 10) is not None
    assert len(kv.get_block_ids("a")[0]) == 3
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 3) is not None  # 13 tokens -> 4 blocks
    assert len(kv.get_block_ids("a")[0]) == 4
    other = make_req("b", range(100, 105))
    assert kv.allocate_slots(other, 5) is None  # nothing left; state unchanged
    assert "b" not in kv.req_to_blocks
    kv.check_integrity()
    kv.free(req)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 4


def test_prefix_hit_shares_blocks_and_counts():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_req("a", range(10))
    assert kv.get_computed_blocks(a) == (None, 0)
    kv.allocate_slots(a, 10)
    b = make_req("b", list(range(8)) + [99, 98, 97])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [h.block_id for h in hits[0]] == kv.get_block_ids("a")[0][:2]
    kv.allocate_slots(b, 3, hits)
    assert kv.pool.blocks[hits[0][0].block_id].ref_cnt == 2
    assert kv.prefix_hits == 8 and kv.prefix_queries == 21
    kv.check_integrity()
    kv.free(a)
    kv.free(b)
    kv.check_integrity()


def test_full_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", range(8))
    kv.allocate_slots(a, 8)
    b = make_req("b", range(8))
    _, n = kv.get_computed_blocks(b)
    assert n == 4  # the last block is not taken: one token must run to produce logits


def test_freed_blocks_are_revived_then_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_req("a", [1, 2, 3, 4])
    kv.allocate_slots(a, 4)
    kv.free(a)  # both blocks free but still cached
    b = make_req("b", [1, 2, 3, 4, 5])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    kv.allocate_slots(b, 1, hits)
    kv.check_integrity()
    kv.free(b)
    # Fill the pool with unrelated tokens: the cached blocks get evicted.
    c = make_req("c", list(range(50, 58)))
    kv.allocate_slots(c, 8)
    d = make_req("d", [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(d)[1] == 0
    kv.free(c)
    kv.check_integrity()


def test_media_hash_folds_into_block_hash():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    toks = [7, 7, 7, 7, 7, 7, 7, 7, 1]
    img_a = [MultiModalFeature("image", "hash-a", 2, 4)]
    img_b = [MultiModalFeature("image", "hash-b", 2, 4)]
    a = make_req("a", toks, img_a)
    kv.allocate_slots(a, len(toks))
    assert kv.get_computed_blocks(make_req("b", toks, img_b))[1] == 0  # same tokens, other image: no sharing
    assert kv.get_computed_blocks(make_req("c", toks, img_a))[1] == 8  # same image: a hit


def test_disabled_caching_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=False)
    a = make_req("a", range(6))
    kv.allocate_slots(a, 6)
    assert kv.get_computed_blocks(make_req("b", range(6))) == (None, 0)
