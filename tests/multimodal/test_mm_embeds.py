"""slice_mm_embeds / merge_mm_embeds: which rows of which item embeddings a window needs, written over the step."""

from __future__ import annotations

import pytest
import torch

from vlserve.multimodal.embeds import merge_mm_embeds, slice_mm_embeds
from vlserve.multimodal.inputs import MultiModalFeature


def test_windows_cut_items():
    feats = [MultiModalFeature("image", "a", 2, 4), MultiModalFeature("video", "b", 8, 3)]
    enc = {"a": torch.arange(4.0)[:, None], "b": 10 + torch.arange(3.0)[:, None]}
    assert slice_mm_embeds(feats, enc, 0, 2) == []
    ((s, e),) = slice_mm_embeds(feats, enc, 0, 4)
    assert s == 2 and e[:, 0].tolist() == [0, 1]
    got = slice_mm_embeds(feats, enc, 4, 10, step_offset=5)  # request starts at row 5 of the step
    assert [(s, e[:, 0].tolist()) for s, e in got] == [(5, [2, 3]), (9, [10, 11])]
    with pytest.raises(KeyError, match="not cached"):
        slice_mm_embeds(feats, {"a": enc["a"]}, 0, 11)
    assert slice_mm_embeds(feats, {"a": enc["a"]}, 0, 11, skip_missing=True)[0][0] == 2  # b left out


def test_merge_writes_rows_and_checks_bounds():
    embeds = torch.zeros(4, 2)
    emb = torch.ones(2, 2, dtype=torch.float64)
    out = merge_mm_embeds(embeds, [(1, emb)])
    assert out is embeds and out[:, 0].tolist() == [0, 1, 1, 0] and out.dtype == torch.float32
    with pytest.raises(ValueError, match=r"\[3, 5\) fall outside the 4 tokens"):
        merge_mm_embeds(embeds, [(3, emb)])
