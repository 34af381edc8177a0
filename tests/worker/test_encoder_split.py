"""Media items divided among tensor-parallel ranks (`mm_encoder_tp_mode="data"`, `vlserve.worker.encoder_split`):
the greedy balance as a pure function, the gather's order over 2 spawned gloo ranks (stand-in items of mixed sizes,
a rank with no item, bf16 rows), a real Qwen2-VL tower split vs whole, and the option's validation."""

from __future__ import annotations

import pytest
import torch

from tests.support.encoder_split_ranks import gather_synthetic_items, synthetic_item, tower_split_vs_whole
from tests.support.tensor_parallel import run_tensor_parallel
from vlserve.config import EngineArgs
from vlserve.worker.encoder_split import balance_items


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    return build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("qwen2_vl")))


def _loads(sizes, owned):
    return [sum(sizes[i] for i in items) for items in owned]


def test_balance_puts_the_largest_first_on_the_least_loaded_rank():
    sizes = [1000, 100, 200, 50]  # vLLM's example: the big image alone, the three small ones together
    assert balance_items(sizes, 2) == [[0], [1, 2, 3]]
    assert balance_items([4, 4, 4, 4], 2) == [[0, 2], [1, 3]]  # ties: the lower index to the lower rank
    assert balance_items([3, 3, 2, 2, 2], 2) == [[0, 2, 4], [1, 3]]  # (LPT: 7 / 5; the optimum 6 / 6 is not greedy)


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_balance_gives_every_item_once_and_stays_within_the_largest_item(num_ranks):
    gen = torch.Generator().manual_seed(num_ranks)
    for _ in range(50):
        sizes = torch.randint(1, 200, (int(torch.randint(0, 12, (1,), generator=gen)),), generator=gen).tolist()
        owned = balance_items(sizes, num_ranks)
        assert len(owned) == num_ranks
        assert sorted(i for items in owned for i in items) == list(range(len(sizes)))
        assert all(items == sorted(items) for items in owned)
        loads = _loads(sizes, owned)
        if sizes:  # greedy's bound: the fullest rank exceeds the emptiest by at most one item
            assert max(loads) - min(loads) <= max(sizes)
        if len(sizes) >= num_ranks:
            assert all(owned)  # nobody idles while there are items for everyone


def test_balance_with_fewer_items_than_ranks_leaves_ranks_empty():
    assert balance_items([5], 3) == [[0], [], []]
    assert balance_items([], 2) == [[], []]
    with pytest.raises(ValueError, match="num_ranks"):
        balance_items([1], 0)


def test_gather_returns_every_item_in_order_on_every_rank():
    """Mixed sizes (the order on the wire differs from item order), then one item for two ranks (a rank idles and
    learns the row width and dtype from the header), in bf16."""
    cases = [([5, 1, 3, 2, 4, 7], 4, "float32"), ([3], 6, "bfloat16")]
    for lengths, width, dtype_name in cases:
        ranks = run_tensor_parallel(gather_synthetic_items, 2, lengths, width, dtype_name)
        owned = balance_items(lengths, 2)
        assert [r["mine"] for r in ranks] == [items or None for items in owned]
        dtype = getattr(torch, dtype_name)
        want = [synthetic_item(i, n, width, dtype) for i, n in enumerate(lengths)]
        for rank in ranks:
            assert len(rank["items"]) == len(lengths)
            for got, expected in zip(rank["items"], want):
                assert got.dtype == dtype
                assert torch.equal(got, expected)


def test_qwen2_vl_tower_split_over_two_ranks_equals_the_whole_call(qwen2_vl_dir):
    grids = [(1, 4, 4), (1, 8, 6), (1, 2, 2), (1, 4, 6), (1, 6, 4)]  # 4, 12, 1, 6, 6 embeddings
    ranks = run_tensor_parallel(tower_split_vs_whole, 2, qwen2_vl_dir, grids)
    assert [r["mine"] for r in ranks] == [[0, 1], [2, 3, 4]]  # 16 / 13 embeddings
    lengths = [t * h * w // 4 for t, h, w in grids]
    for rank in ranks:
        whole = rank["whole"].split(lengths)
        for got, want in zip(rank["split"], whole, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for got0, got1 in zip(ranks[0]["split"], ranks[1]["split"]):
        assert torch.equal(got0, got1)  # every rank holds the same rows: the owner's


def test_mm_encoder_tp_mode_is_checked():
    assert EngineArgs(model="m").mm_encoder_tp_mode == "weights"
    assert EngineArgs(model="m", mm_encoder_tp_mode="data").mm_encoder_tp_mode == "data"  # TP 1: accepted, no effect
    for bad in ("dp", "", None, "DATA"):
        with pytest.raises(ValueError, match="mm_encoder_tp_mode must be one of weights, data"):
            EngineArgs(model="m", mm_encoder_tp_mode=bad)


def test_runner_splits_each_modality_and_encodes_what_one_rank_alone_found():
    """EncoderRunner over 2 ranks: images, videos and audio of mixed lengths; each modality's items divided among
    the ranks (a lone clip encoded on both), every rank ends with every item's rows; h1, found by rank 0's connector only, is encoded (the
    ranks agree), so rank 0 does not keep its loaded copy."""
    from tests.support.encoder_split_ranks import StandInTower, runner_step_split

    items = [("image", 3), ("image", 5), ("video", 4), ("image", 2), ("audio", 6), ("video", 1), ("image", 4)]
    ranks = run_tensor_parallel(runner_step_split, 2, items, 3, ["h1"])
    for rank in ranks:
        for i, (modality, n) in enumerate(items):
            want = synthetic_item(i, n, 3, torch.float32) + StandInTower.OFFSETS[modality]
            assert torch.equal(rank["outputs"][f"h{i}"], want), (i, modality)
        assert rank["total"] == len(items)
        assert rank["saved"] == [f"h{i}" for i in (0, 1, 3, 6, 2, 5, 4)]  # by modality group, item order within
    assert sum(rank["local"] for rank in ranks) == len(items) + 1  # the lone audio clip runs on both ranks
    images = [sum(n for m, n in rank["calls"] if m == "image") for rank in ranks]
    videos = [sum(n for m, n in rank["calls"] if m == "video") for rank in ranks]
    assert images == [2, 2] and videos == [1, 1]  # 4 images: lengths 3 5 2 4 -> {5, 2} / {4, 3}
    assert [sum(n for m, n in rank["calls"] if m == "audio") for rank in ranks] == [1, 1]  # alone: no gather
