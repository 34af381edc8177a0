"""`EncoderPlan.reads_remote_media`: a plan that would encode (whole or a slice of) a disaggregated consumer's
media-less item says so; plans that only reuse it, or touch only local items, do not."""

from __future__ import annotations

from vlserve.core.encoder_plan import NO_MEDIA, EncoderPlan
from vlserve.core.sched_output import EncoderSlice
from vlserve.multimodal.inputs import MultiModalFeature, feature_from_remote


def test_plan_reads_remote_media_only_when_it_encodes_such_an_item():
    local = MultiModalFeature("image", "h0", 0, 4, {})
    remote = feature_from_remote({"modality": "image", "mm_hash": "h1", "offset": 4, "length": 4})
    features = [local, remote]
    assert not NO_MEDIA.reads_remote_media(features)
    assert not EncoderPlan(reuse=["h1"], to_encode=[0]).reads_remote_media(features)
    assert EncoderPlan(to_encode=[1]).reads_remote_media(features)
    assert EncoderPlan(slices=[EncoderSlice("h1", 1, 0, 2, 4)]).reads_remote_media(features)
    assert not EncoderPlan(slices=[EncoderSlice("h0", 0, 0, 2, 4)]).reads_remote_media(features)
