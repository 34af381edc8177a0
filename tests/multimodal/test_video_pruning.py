"""Video pruning's pure parts: the kept count rule, the retention mask on hand-made embeddings, rate checks, the
processor's placeholders and mm_hash, and the M-RoPE positions of a pruned video."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.multimodal.mm_media import rand_video
from vlserve.multimodal.inputs import MultiModalFeature
from vlserve.multimodal.mrope import get_mrope_positions
from vlserve.multimodal.video_pruning import (
    KEEP_KEY,
    check_video_pruning_rate,
    frame_keep_counts,
    frame_retention_mask,
    kept_token_indices,
    pruned_mm_hash,
    pruned_video_data,
    retained_token_count,
    retention_mask,
)


@pytest.mark.parametrize(
    ("per_group", "groups", "rate", "expected"),
    [
        (9, 4, 0.0, 36),
        (9, 4, 0.5, 18),
        (9, 4, 0.75, 9),
        (9, 4, 0.9, 9),  # never below one whole group
        (10, 3, 0.5, 15),
        (6, 5, 0.3, 21),  # floor(30 * 0.7) = 21
        (7, 3, 0.5, 10),  # floor(10.5)
        (4, 1, 0.5, 4),  # a one-group video keeps its group
    ],
)
def test_kept_count_rule(per_group, groups, rate, expected):
    assert retained_token_count(per_group, groups, rate) == expected
    assert expected == max(per_group, math.floor(per_group * groups * (1 - rate) + 1e-9))


def test_frame_keep_counts_spread_the_rest_evenly():
    assert frame_keep_counts(9, 4, 0.5) == [9, 3, 3, 3]  # 18 - 9 over 3 steps
    assert frame_keep_counts(9, 3, 0.5) == [9, 2, 2]  # floor(13.5) = 13
    assert frame_keep_counts(10, 4, 0.5) == [10, 4, 3, 3]  # 20 - 10: the remainder to the earlier steps
    assert frame_keep_counts(4, 4, 0.75) == [4, 0, 0, 0]
    assert frame_keep_counts(4, 1, 0.5) == [4]
    for per_group, groups, rate in [(6, 5, 0.3), (9, 7, 0.6), (16, 2, 0.25)]:
        counts = frame_keep_counts(per_group, groups, rate)
        assert sum(counts) == retained_token_count(per_group, groups, rate)


def _unit(deg: float) -> list[float]:
    return [math.cos(math.radians(deg)), math.sin(math.radians(deg))]


def test_retention_mask_hand_case():
    """t=3 groups of 1x3 tokens in 2-d. Changes from the previous group (1 - cos):
    group 1: token 0 static (0), token 1 turned 90 degrees (1), token 2 turned 45 degrees (0.29);
    group 2: token 0 reversed (2), tokens 1 and 2 static (0).
    Rate 0.25 keeps floor(9 * 0.75) = 6: group 0 whole, then the three that changed: g2t0, g1t1, g1t2."""
    g0 = [_unit(0), _unit(0), _unit(0)]
    g1 = [_unit(0), _unit(90), _unit(45)]
    g2 = [_unit(180), _unit(90), _unit(45)]
    emb = torch.tensor(g0 + g1 + g2)  # [9, 2]
    mask = retention_mask(emb * 3.0, (3, 1, 3), 0.25)  # scale does not matter to cosine
    assert mask.tolist() == [True, True, True, False, True, True, True, False, False]
    assert kept_token_indices(mask).tolist() == [0, 1, 2, 4, 5, 6]
    # rate 0.5 keeps 4: the group and the largest change (the reversed token)
    assert retention_mask(emb, (3, 1, 3), 0.5).tolist() == [True] * 3 + [False] * 3 + [True, False, False]
    # rate 0 keeps everything
    assert retention_mask(emb, (3, 1, 3), 0.0).all()


def test_retention_mask_ties_keep_the_earlier_token_and_static_video_keeps_first_group():
    emb = torch.tensor([[1.0, 0.0], [0.0, 2.0]]).repeat(4, 1)  # a static 4-group video of 2 tokens [8, 2]
    mask = retention_mask(emb, (4, 1, 2), 0.5)  # keep 4: group 0, then (all changes 0) the earliest
    assert mask.tolist() == [True, True, True, True, False, False, False, False]
    with pytest.raises(ValueError, match="do not fill a grid"):
        retention_mask(emb, (3, 1, 2), 0.5)


def test_frame_retention_mask_hand_case():
    prev = torch.tensor([_unit(0), _unit(0), _unit(0), _unit(0)])
    cur = torch.tensor([_unit(10), _unit(170), _unit(0), _unit(60)])  # changes: 0.015, 1.98, 0, 0.5
    assert frame_retention_mask(cur, prev, 2).tolist() == [False, True, False, True]
    assert frame_retention_mask(cur, prev, 0).tolist() == [False] * 4


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), "0.5", True])
def test_bad_rates_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="video_pruning_rate"):
        check_video_pruning_rate(bad)
    assert check_video_pruning_rate(None) == 0.0 and check_video_pruning_rate(0) == 0.0


def test_engine_args_refuse_a_bad_rate():
    from vlserve.config import EngineArgs

    with pytest.raises(ValueError, match="video_pruning_rate"):
        EngineArgs(video_pruning_rate=1.0)
    assert EngineArgs(video_pruning_rate=0.5).processor_kwargs() == {"video_pruning_rate": 0.5}
    assert EngineArgs().processor_kwargs() == {}


def test_pruned_mm_hash_differs_per_rate():
    assert pruned_mm_hash("abc", 0.0) == "abc"
    hashes = {pruned_mm_hash("abc", r) for r in (0.0, 0.25, 0.5, 0.75)}
    assert len(hashes) == 4


def test_processor_placeholders_and_hash(qwen2_vl_dir):
    from vlserve.multimodal.processor import MultiModalProcessor

    proc = MultiModalProcessor.from_pretrained(qwen2_vl_dir)
    pad = proc.video_token_id
    frames = rand_video(8, 56, 84, seed=3)
    prompt = [1, 2, pad, 3]
    base_ids, (base,) = proc.process(prompt, videos=[frames])
    same_ids, (same,) = proc.process(prompt, videos=[frames], mm_processor_kwargs={"video_pruning_rate": 0.0})
    assert same_ids == base_ids and same.mm_hash == base.mm_hash and same.data is base.data  # R = 0: unchanged
    t, h, w = (int(v) for v in base.data["video_grid_thw"][0])
    per_group = (h // 2) * (w // 2)
    seen = {base.mm_hash}
    for rate in (0.5, 0.75):
        ids, (feat,) = proc.process(prompt, videos=[frames], mm_processor_kwargs={"video_pruning_rate": rate})
        kept = retained_token_count(per_group, t, rate)
        assert feat.length == kept == ids.count(pad) and feat.data[KEEP_KEY] == kept
        assert len(ids) == len(base_ids) - (base.length - kept)
        seen.add(feat.mm_hash)
    assert len(seen) == 3  # the encoder cache / prefix cache key differs per rate
    with pytest.raises(ValueError, match="video_pruning_rate"):
        proc.process(prompt, videos=[frames], mm_processor_kwargs={"video_pruning_rate": 1.0})


class _Cfg:
    class vision_config:  # noqa: N801 - a stand-in for an HF config
        spatial_merge_size = 2


def test_mrope_positions_of_kept_tokens_and_text_after():
    """A pruned video's tokens take their grid positions, and the text after it keeps its unpruned positions."""
    grid = torch.tensor([[3, 4, 4]])  # merged 3 x 2 x 2 = 12 tokens
    full = MultiModalFeature("video", "v", 2, 12, {"video_grid_thw": grid})
    ids_full = [0, 0] + [9] * 12 + [0, 0, 0]
    full_pos, full_delta = get_mrope_positions(ids_full, [full], _Cfg)
    kept = torch.tensor([0, 1, 2, 3, 5, 10])  # group 0 whole, then two more
    data = pruned_video_data({"video_grid_thw": grid}, 0.5, (3, 2, 2))
    assert data[KEEP_KEY] == 6
    pruned = MultiModalFeature("video", "v-evs", 2, 6, data)
    ids = [0, 0] + [9] * 6 + [0, 0, 0]
    pos, delta = get_mrope_positions(ids, [pruned], _Cfg, kept_indices={"v-evs": kept})
    keep_cols = [0, 1] + [2 + int(k) for k in kept] + [14, 15, 16]
    assert torch.equal(pos, full_pos[:, keep_cols])
    assert delta == full_delta + 6  # the same next position, 6 fewer tokens
    provisional, _ = get_mrope_positions(ids, [pruned], _Cfg)  # before the tower: the grid's first 6
    assert torch.equal(provisional[:, 2:8], full_pos[:, 2:8])
    with pytest.raises(ValueError, match="needs 6 tokens"):
        get_mrope_positions([0] * 2 + [9] * 7 + [0], [MultiModalFeature("video", "x", 2, 7, data)], _Cfg)


def test_numpy_oracle_agrees_with_the_mask_on_random_embeddings():
    """The test oracle's own ranking (tests/support/pruning_oracle.py) and retention_mask pick the same tokens."""
    from tests.support.pruning_oracle import per_group_flags, whole_video_flags

    emb = torch.from_numpy(np.random.RandomState(0).randn(5 * 6, 8).astype(np.float32))
    for rate in (0.3, 0.5, 0.75):
        assert retention_mask(emb, (5, 2, 3), rate).numpy().tolist() == whole_video_flags(emb.numpy(), 5, rate).tolist()
        flags = per_group_flags(emb.numpy(), 5, rate)
        counts = frame_keep_counts(6, 5, rate)
        assert [int(f.sum()) for f in flags.reshape(5, 6)] == counts
        frames = emb.reshape(5, 6, 8)
        for j in range(1, 5):
            assert (
                frame_retention_mask(frames[j], frames[j - 1], counts[j]).numpy().tolist()
                == flags[j * 6 : (j + 1) * 6].tolist()
            )


def test_a_model_whose_videos_cannot_be_pruned_refuses_the_rate(tmp_path):
    from tests.support.internvl_checkpoints import build_internvl_checkpoint
    from vlserve import LLM

    model_dir = build_internvl_checkpoint(str(tmp_path / "internvl"))
    with pytest.raises(ValueError, match="video_pruning_rate applies to Qwen2-VL"):
        LLM(model_dir, dtype="float32", num_kv_blocks=64, video_pruning_rate=0.5)
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64)
    proc = llm.input_processor.mm_processor
    with pytest.raises(ValueError, match="video_pruning_rate applies to Qwen2-VL"):
        proc.process(
            [proc.video_token_id], videos=[rand_video(4, 64, 64)], mm_processor_kwargs={"video_pruning_rate": 0.5}
        )
