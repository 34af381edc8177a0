"""slice_mm_embeds: which rows of which item embeddings a prefill window needs."""
from __future__ import annotations

import pytest
import torch

from vlserve.multimodal.embeds import slice_mm_embeds
from vlserve.multimodal.inputs import MultiModalFeature


def test_windows_cut_items():
    feats = [MultiModalFeature("image", "a", 2, 4), MultiModalFeature("video", "b", 8, 3)]
    enc = {"a": torch.arange(4.0)[:, None], "b": 10 + torch.arange(3.0)[:, None]}
    assert slice_mm_embeds(feats, enc, 0, 2) == []
    (s, e), = slice_mm_embeds(feats, enc, 0, 4)
    assert s == 2 and e[:, 0].tolist() == [0, 1]
    got = slice_mm_embeds(feats, enc, 4, 10, step_offset=5)  # request starts at row 5 of the step
    assert [(s, e[:, 0].tolist()) for s, e in got] == [(5, [2, 3]), (9, [10, 11])]
    with pytest.raises(KeyError, match="not cached"):
        slice_mm_embeds(feats, {"a": enc["a"]}, 0, 11)
