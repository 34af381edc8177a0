"""Tensor-parallel vision towers (`mm_encoder_tp_mode="weights"`, `vlserve.models.tower_sharding`): over 2 spawned
gloo ranks the Qwen2-VL, Qwen2.5-VL and Qwen3-VL towers, split by heads and MLP width, give the whole tower's
embeddings on every rank (INT8 towers as close to float as the whole INT8 tower); in process, a tower whose heads do
not divide stays whole, and one rank changes nothing."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_tensor_parallel import fake_rank
from tests.support.encoder_split_ranks import sharded_tower_vs_whole
from tests.support.tensor_parallel import run_tensor_parallel
from vlserve.encoders.vision_layers import VisionTowerConfig
from vlserve.models.tower_sharding import shard_tower_blocks

GRIDS = [(1, 4, 4), (1, 8, 6), (1, 2, 2)]


@pytest.fixture(scope="module")
def tower_dirs(tmp_path_factory):
    from tests.support.qwen3_vl_checkpoints import build_qwen3_vl_checkpoint
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    def qwen2(variant):
        return build_qwen2_vl_checkpoint(
            str(tmp_path_factory.mktemp(variant)), variant=variant, vision_embed_dim=64, vision_num_heads=4
        )

    return {
        "qwen2_vl": qwen2("qwen2_vl"),
        "qwen2_5_vl": qwen2("qwen2_5_vl"),
        "qwen3_vl": build_qwen3_vl_checkpoint(str(tmp_path_factory.mktemp("qwen3_vl")), vision_num_heads=2),
    }


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_two_ranks_sharded_tower_equals_the_whole_tower(tower_dirs, name):
    ranks = run_tensor_parallel(sharded_tower_vs_whole, 2, tower_dirs[name], GRIDS, "float32")
    for rank in ranks:
        assert rank["sharded_qkv_rows"] * 2 == rank["whole_qkv_rows"]  # half the heads of q, k and v
        assert rank["sharded_params"] < rank["whole_params"]
        torch.testing.assert_close(rank["sharded"], rank["whole"], atol=1e-5, rtol=1e-5)
    assert torch.equal(ranks[0]["sharded"], ranks[1]["sharded"])  # the all-reduce gives every rank the same sum


def test_two_ranks_sharded_int8_tower_stays_close_to_the_whole_int8_tower(tower_dirs):
    """INT8 towers quantize after the split: each rank's down projections quantize their own columns' activations
    (a per-token scale over half a row), so the sharded INT8 tower is as far from the float one as the whole INT8
    tower is, not further."""
    ranks = run_tensor_parallel(sharded_tower_vs_whole, 2, tower_dirs["qwen2_vl"], GRIDS, "float32", "int8")

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    for rank in ranks:
        whole_error, sharded_error = rel(rank["whole"], rank["float"]), rel(rank["sharded"], rank["float"])
        assert 0 < whole_error < 0.05 and 0 < sharded_error < 1.5 * whole_error, (whole_error, sharded_error)


def test_heads_that_do_not_divide_keep_the_tower_whole_and_one_rank_changes_nothing(caplog):
    from vlserve.encoders import Qwen2VisionTower

    cfg = VisionTowerConfig(depth=1, width=24, num_heads=3, mlp_hidden=48, hidden_act="quick_gelu", out_dim=16)
    tower = Qwen2VisionTower(cfg)
    assert shard_tower_blocks([tower]) == 0  # one rank: untouched
    with fake_rank(0, 2):
        assert shard_tower_blocks([tower]) == 0
    assert "3 heads and MLP width [48] do not divide by tensor_parallel_size 2" in caplog.text
    assert tower.blocks[0].attn.num_heads == 3 and tower.blocks[0].attn.qkv.out_features == 72  # whole
