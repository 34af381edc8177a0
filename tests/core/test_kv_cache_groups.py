"""KV cache groups: grouping layers, the sliding-window group's dropped blocks, prefix hits within a window, and the
pool's invariants under random traffic (pure Python)."""

import random

import pytest

from vlserve.core.kv_cache_groups import group_layers
from vlserve.core.kv_cache_manager import KVCacheManager, cdiv
from vlserve.core.request import EngineCoreRequest, Request
from vlserve.sampling_params import SamplingParams

BS = 4
W = 8  # window: a query at p reads p - 7 .. p


def make_req(rid, tokens):
    return Request(EngineCoreRequest(rid, list(tokens), SamplingParams(max_tokens=64), 0.0, []), 64)


def test_one_kind_of_attention_is_one_group_of_every_layer():
    groups = group_layers([None] * 4)
    assert groups.layers == ((0, 1, 2, 3),) and groups.windows == (None,) and groups.num_slots == 4
    assert not groups.frees_out_of_window
    assert group_layers([7] * 3).windows == (7,)


def test_gemma_pattern_groups_by_the_smallest_kind():
    windows = ([W] * 5 + [None]) * 2  # five sliding layers, then a full one, twice
    groups = group_layers(windows)
    assert groups.num_slots == 2
    assert groups.layers == ((5, 11), (0, 1), (2, 3), (4, 6), (7, 8), (9, 10))
    assert groups.windows == (None,) + (W,) * 5
    assert groups.frees_out_of_window
    assert [groups.group_of(layer) for layer in (0, 5, 6, 11)] == [1, 0, 3, 0]
    assert [groups.slot_of(layer) for layer in (0, 1, 5, 11, 6)] == [0, 1, 0, 1, 1]
    assert groups.num_layers == 12


def _held(kv, rid, group):
    null = kv.pool.null_block
    return sum(1 for b in kv.req_to_blocks[rid][group] if b is not null)


def _prefill_in_chunks(kv, req, chunk):
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        kv.check_integrity()


def test_the_sliding_group_drops_blocks_that_left_its_window():
    kv = KVCacheManager(num_blocks=64, block_size=BS, group_windows=(None, W))
    assert kv.pool.null_block is not None and kv.pool.num_usable_blocks == 63
    req = make_req("a", range(40))
    _prefill_in_chunks(kv, req, chunk=4)
    ids = kv.get_block_ids("a")
    assert len(ids[0]) == len(ids[1]) == 10
    assert 0 not in ids[0]  # the full group keeps every block
    # before the last chunk (computed 36) a query at 36 reads 29.., so blocks 0..6 went; 7..9 are held
    assert ids[1][:7] == [0] * 7 and 0 not in ids[1][7:]
    assert _held(kv, "a", 1) == 3
    kv.free(req)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 63


def test_dropping_needs_the_window_not_the_chunk_to_move_past_a_block():
    kv = KVCacheManager(num_blocks=64, block_size=BS, group_windows=(None, W))
    req = make_req("a", range(12))
    assert kv.allocate_slots(req, 12) is not None  # one chunk: every block is read by some query in it
    req.num_computed_tokens = 12
    assert _held(kv, "a", 1) == 3
    req.append_output_token_ids([5])
    kv.allocate_slots(req, 1)  # decode at 12 reads 5..12: block 0 (0..3) goes
    assert kv.get_block_ids("a")[1][0] == 0 and _held(kv, "a", 1) == 3
    kv.check_integrity()


def test_prefix_hit_needs_only_the_window_blocks_of_the_sliding_group():
    kv = KVCacheManager(num_blocks=64, block_size=BS, group_windows=(None, W))
    a = make_req("a", range(24))
    _prefill_in_chunks(kv, a, chunk=4)
    kv.free(a)  # every block free, hashes kept (the dropped sliding blocks too)
    b = make_req("b", list(range(24)) + [99])
    hits, n = kv.get_computed_blocks(b)
    assert n == 24
    # a query at 24 reads 17..24: blocks 4 and 5 of the sliding group; 0..3 are the null block
    assert [blk.block_id for blk in hits[1][:4]] == [0] * 4 and all(blk.block_id for blk in hits[1][4:])
    assert len(hits[0]) == len(hits[1]) == 6
    assert kv.allocate_slots(b, 1, hits) is not None
    kv.check_integrity()
    kv.free(b)
    kv.check_integrity()


def test_an_evicted_window_block_shortens_the_hit():
    kv = KVCacheManager(num_blocks=64, block_size=BS, group_windows=(None, W))
    a = make_req("a", range(24))
    assert kv.allocate_slots(a, 24) is not None
    a.num_computed_tokens = 24
    # the sliding group's block 5 (tokens 20..23) loses its hash: a hit must end at or before block 5
    block5 = kv.req_to_blocks["a"][1][5]
    kv.pool._evict_hash(block5)
    hits, n = kv.get_computed_blocks(make_req("b", list(range(24)) + [1]))
    assert n == 20  # a query at 20 reads 13..20: blocks 3 and 4, both cached
    assert len(hits[0]) == 5
    kv.free(a)
    kv.check_integrity()


def test_groups_never_share_a_cached_block():
    kv = KVCacheManager(num_blocks=32, block_size=BS, group_windows=(None, W, W))
    a = make_req("a", range(9))
    kv.allocate_slots(a, 9)
    ids = kv.get_block_ids("a")
    assert len({*ids[0], *ids[1], *ids[2]}) == 9  # three blocks per group, all distinct
    hits, n = kv.get_computed_blocks(make_req("b", range(9)))
    assert n == 8 and [[blk.block_id for blk in g] for g in hits] == [g[:2] for g in ids]


def test_max_request_tokens_counts_only_the_window_for_a_sliding_group():
    full = KVCacheManager(num_blocks=65, block_size=BS)
    assert full.max_request_tokens(16) == 65 * BS
    hybrid = KVCacheManager(num_blocks=65, block_size=BS, group_windows=(None, W))
    # the sliding group needs at most cdiv(8 + 16, 4) + 1 = 7 blocks; the full group the rest of the 64
    assert hybrid.max_request_tokens(16) == (64 - 7) * BS
    req = make_req("long", range((64 - 7) * BS - 1))
    _prefill_in_chunks(hybrid, req, chunk=16)
    hybrid.check_integrity()


@pytest.mark.parametrize("seed", range(3))
def test_random_traffic_keeps_the_pool_whole(seed):
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=48, block_size=BS, group_windows=(None, W, W))
    live: dict[str, Request] = {}
    prefixes = [list(range(100, 100 + 16)), list(range(300, 300 + 12))]
    for step in range(300):
        if len(live) < 4 and rng.random() < 0.3:
            toks = rng.choice(prefixes)[: rng.randint(4, 16)] + [rng.randint(0, 50) for _ in range(rng.randint(1, 12))]
            req = make_req(f"r{step}", toks)
            hits, n = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, min(8, req.num_tokens - n), hits) is not None:
                req.num_computed_tokens = n + min(8, req.num_tokens - n)
                live[req.request_id] = req
        for rid, req in list(live.items()):
            if req.num_computed_tokens >= req.num_tokens:
                req.append_output_token_ids([rng.randint(0, 50)])
            n = min(8, req.num_tokens - req.num_computed_tokens)
            if kv.allocate_slots(req, n, num_lookahead_tokens=rng.choice([0, 2])) is None or rng.random() < 0.05:
                kv.free(req)  # preempted or finished
                del live[rid]
                continue
            req.num_computed_tokens += n
            # every sliding group still holds each block a query from here on reads
            first = max(0, req.num_computed_tokens - W + 1) // BS  # what the next query reads
            for g in (1, 2):
                held = kv.req_to_blocks[rid][g]
                assert all(b is not kv.pool.null_block for b in held[first : cdiv(req.num_computed_tokens, BS)])
        kv.check_integrity()
    for req in live.values():
        kv.free(req)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
