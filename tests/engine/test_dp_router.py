"""DPRouter: media / prompt-prefix affinity, the load rule, ownership for aborts."""

from __future__ import annotations

import pytest

from vlserve.engine.dp_router import DPRouter


def test_same_image_or_prefix_goes_to_the_same_replica():
    router = DPRouter(4, margin=8, block_size=16, prefix_blocks=2)
    shared = list(range(32))  # exactly the affinity window: 2 blocks of 16
    by_prefix = {router.choose(shared + [1000 + i] * 5) for i in range(20)}
    assert len(by_prefix) == 1  # tokens after the window do not matter
    by_image = {router.choose([7, 8, 9, i], mm_hashes=["img-a", f"img-{i}"]) for i in range(20)}
    assert len(by_image) == 1  # the first media item decides, not the text or later items
    other = DPRouter(4, margin=8, block_size=16, prefix_blocks=2)
    assert other.choose(shared) == router.choose(shared)  # stable across instances (and processes)


def test_distinct_prompts_spread_over_the_replicas():
    router = DPRouter(2, margin=100)
    chosen = [router.route(f"r{i}", [i, i + 1, i + 2]) for i in range(40)]
    assert chosen.count(0) > 5 and chosen.count(1) > 5
    mm = [router.choose([1, 2, 3], mm_hashes=[f"hash-{i}"]) for i in range(40)]
    assert 0 in mm and 1 in mm


def test_load_rule_diverts_only_when_the_affinity_replica_is_much_busier():
    router = DPRouter(3, margin=2)
    prompt = [5, 6, 7]
    home = router.affinity_replica(prompt)
    routed = [router.route(f"r{i}", prompt) for i in range(3)]
    assert routed == [home] * 3  # 0, 1, 2 open there: not above 2 * 0 + 2 until the third is counted
    assert router.loads[home] == 3
    fourth = router.route("r3", prompt)  # 3 > 2 * 0 + 2: the least loaded (lowest index on ties)
    assert fourth == min(i for i in range(3) if i != home)
    assert router.route("r4", prompt) != home
    # the affinity replica wins again once its load falls back within the rule
    for i in range(3):
        assert router.release(f"r{i}") == home
    assert router.route("r5", prompt) == home


def test_n_sequences_count_as_load_and_release_restores_it():
    router = DPRouter(2, margin=0)
    replica = router.route("a", [1, 2], num_seqs=4)
    assert router.loads[replica] == 4 and router.owner("a") == replica
    assert router.release("a") == replica and router.loads == [0, 0] and router.open_requests == 0
    assert router.release("a") is None and router.owner("a") is None  # a second release is a no-op


def test_one_replica_and_bad_input():
    router = DPRouter(1, margin=0)
    assert {router.route(f"r{i}", [i]) for i in range(5)} == {0}
    with pytest.raises(ValueError, match="already routed"):
        router.route("r0", [0])
    with pytest.raises(ValueError, match="num_replicas"):
        DPRouter(0, margin=0)
    with pytest.raises(ValueError, match="margin"):
        DPRouter(2, margin=-1)


def test_engine_args_and_offline_llm_refuse_bad_data_parallel_sizes():
    from vlserve import LLM
    from vlserve.config import EngineArgs

    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1, got 0"):
        EngineArgs(data_parallel_size=0)
    with pytest.raises(ValueError, match="only `vlserve serve` starts"):
        LLM(model="unused", data_parallel_size=2)
