"""get_mrope_positions against transformers' own get_rope_index (Qwen2-VL and Qwen2.5-VL)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vlserve.multimodal.inputs import MultiModalFeature
from vlserve.multimodal.mrope import decode_mrope_positions, get_mrope_positions, mrope_positions_for_range

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

TEXT = 50  # an ordinary token id


def _build(cfg, items, texts):
    """Prompt = texts[0] <vs> item0 <ve> texts[1] ... ; items are (modality, (t, h, w), second_per_grid_t)."""
    ids, feats = [TEXT] * texts[0], []
    for (modality, thw, spg), n_text in zip(items, texts[1:]):
        ids.append(cfg.vision_start_token_id)
        n = thw[0] * thw[1] * thw[2] // 4
        tok = cfg.image_token_id if modality == "image" else cfg.video_token_id
        data = (
            {"image_grid_thw": torch.tensor([thw])}
            if modality == "image"
            else {"video_grid_thw": torch.tensor([thw]), "second_per_grid_ts": torch.tensor([spg])}
        )
        feats.append(MultiModalFeature(modality, f"h{len(feats)}", len(ids), n, data))
        ids += [tok] * n + [cfg.vision_end_token_id] + [TEXT] * n_text
    return ids, feats


class _ModelStub(SimpleNamespace):
    """Just enough of the HF model for get_rope_index: its config and (5.x) its helper methods."""

    def __init__(self, model_cls, cfg):
        super().__init__(config=cfg)
        self._cls = model_cls

    def __getattr__(self, name):
        return getattr(self._cls, name).__get__(self)


def _hf_rope_index(cfg, ids, feats):
    """Call the HF model's get_rope_index without building the model (it only reads self.config)."""
    if cfg.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as M
    else:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel as M
    imgs = [f.data["image_grid_thw"] for f in feats if f.modality == "image"]
    vids = [f for f in feats if f.modality == "video"]
    kwargs = dict(
        input_ids=torch.tensor([ids]),
        image_grid_thw=torch.cat(imgs) if imgs else None,
        video_grid_thw=torch.cat([f.data["video_grid_thw"] for f in vids]) if vids else None,
    )
    if cfg.model_type == "qwen2_5_vl" and vids:
        kwargs["second_per_grid_ts"] = torch.cat([f.data["second_per_grid_ts"] for f in vids])
    import inspect

    if "mm_token_type_ids" in inspect.signature(M.get_rope_index).parameters:  # 5.x: modality of each token
        types = [1 if t == cfg.image_token_id else 2 if t == cfg.video_token_id else 0 for t in ids]
        kwargs["mm_token_type_ids"] = torch.tensor([types], dtype=torch.int32)
    pos, delta = M.get_rope_index(_ModelStub(M, cfg), **kwargs)
    return pos[:, 0], int(delta.reshape(-1)[0])  # [3, L]


@pytest.fixture(scope="module")
def configs(qwen2_vl_dir, qwen2_5_vl_dir):
    from transformers import AutoConfig

    return {
        "qwen2_vl": AutoConfig.from_pretrained(qwen2_vl_dir),
        "qwen2_5_vl": AutoConfig.from_pretrained(qwen2_5_vl_dir),
    }


CASES = {
    "one_image": ([("image", (1, 4, 6), None)], [3, 5]),
    "image_first_token": ([("image", (1, 2, 2), None)], [0, 0]),
    "images_and_videos": (
        [("image", (1, 4, 4), None), ("video", (3, 2, 4), 1.0), ("image", (1, 6, 2), None), ("video", (2, 4, 2), 2.0)],
        [2, 4, 0, 3, 6],
    ),
    "video_fractional_seconds": ([("video", (4, 2, 2), 0.5), ("video", (3, 2, 2), 1.5)], [1, 2, 2]),
    "many_frames_tall": ([("video", (6, 8, 2), 1.0), ("image", (1, 2, 12), None)], [5, 1, 7]),
}


@pytest.mark.parametrize("variant", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_hf_get_rope_index(configs, variant, case):
    from tests.support.hf_generate import transformers_major

    cfg = configs[variant]
    if transformers_major() >= 5 and any(m == "video" for m, _, _ in CASES[case][0]):
        pytest.skip(
            "transformers 5.x moves the text after a video on by max(h, w) and keeps fractional temporal "
            "steps, not the rule the checkpoints were trained with (4.57's, kept by vlserve): checked on 4.57 "
            "in the hf_parity job, and by hand in test_text_after_a_video_follows_its_last_position"
        )
    ids, feats = _build(cfg, *CASES[case])
    pos, delta = get_mrope_positions(ids, feats, cfg)
    ref_pos, ref_delta = _hf_rope_index(cfg, ids, feats)
    assert pos.shape == (3, len(ids)) and pos.dtype == torch.long
    assert torch.equal(pos, ref_pos), f"\n{pos}\n{ref_pos}"
    assert delta == ref_delta


def test_text_only(configs):
    pos, delta = get_mrope_positions([TEXT] * 7, [], configs["qwen2_vl"])
    assert torch.equal(pos, torch.arange(7).expand(3, -1)) and delta == 0


def test_qwen2_5_video_time_scaling(configs):
    cfg = configs["qwen2_5_vl"]  # tokens_per_second = 2
    ids, feats = _build(cfg, [("video", (3, 2, 2), 2.0)], [1, 1])
    pos, delta = get_mrope_positions(ids, feats, cfg)
    vid = pos[:, feats[0].offset : feats[0].end]
    start = feats[0].offset
    assert vid[0].tolist() == [start + 4 * t for t in range(3) for _ in range(1)]  # t * 2 s * 2 tok/s
    assert pos[:, -1].tolist() == [start + 8 + 1 + 1] * 3  # vision_end, then the last text token
    # Float seconds (original Qwen / vLLM) differ from HF's truncation only for fractional values.
    ids, feats = _build(cfg, [("video", (3, 2, 2), 0.75)], [0, 0])
    trunc, _ = get_mrope_positions(ids, feats, cfg)
    flt, _ = get_mrope_positions(ids, feats, cfg, truncate_second_per_grid=False)
    assert trunc[0, 1:4].tolist() == [1, 1, 1]  # HF: int(0.75) == 0, no time spread
    assert flt[0, 1:4].tolist() == [1, 2, 4]  # 1 + floor(t * 0.75 * 2)


def test_decode_positions_continue_after_prompt(configs):
    cfg = configs["qwen2_5_vl"]
    ids, feats = _build(cfg, *CASES["images_and_videos"])
    pos, delta = get_mrope_positions(ids, feats, cfg)
    L = len(ids)
    assert delta == int(pos.max()) + 1 - L
    dec = decode_mrope_positions(delta, L, L + 3)
    assert dec.shape == (3, 3) and dec[0].tolist() == [pos.max() + 1, pos.max() + 2, pos.max() + 3]
    assert torch.equal(dec[0], dec[2])
    both = mrope_positions_for_range(pos, delta, L - 2, L + 2)
    assert torch.equal(both, torch.cat([pos[:, L - 2 :], decode_mrope_positions(delta, L, L + 2)], dim=1))
    assert torch.equal(mrope_positions_for_range(pos, delta, 3, 9), pos[:, 3:9])


def test_inconsistent_feature_rejected(configs):
    cfg = configs["qwen2_vl"]
    ids, feats = _build(cfg, [("image", (1, 4, 4), None)], [1, 1])
    feats[0].length += 1
    with pytest.raises(ValueError, match="needs 4 tokens"):
        get_mrope_positions(ids, feats, cfg)


@pytest.mark.parametrize("variant", ["qwen2_vl", "qwen2_5_vl"])
def test_text_after_a_video_follows_its_last_position(configs, variant):
    """By hand, independent of the installed transformers: text T T, <vs>, a video of 2 temporal steps on a 1x1
    merged grid, <ve>, text T T. The video's temporal ids are 3 + k * interval (interval 1 for Qwen2-VL,
    int(second_per_grid) * tokens_per_second for Qwen2.5-VL); the text after it starts at its largest id + 1."""
    cfg = configs[variant]
    ids, feats = _build(cfg, [("video", (2, 2, 2), 1.0)], [2, 2])
    tps = getattr(cfg.vision_config, "tokens_per_second", None)
    interval = 1 if variant == "qwen2_vl" else int(1.0) * tps
    last = 3 + interval  # the second temporal step of the video
    after = [last + 1, last + 2, last + 3]  # <ve>, T, T
    expected = torch.tensor([[0, 1, 2, 3, last] + after, [0, 1, 2, 3, 3] + after, [0, 1, 2, 3, 3] + after])
    pos, delta = get_mrope_positions(ids, feats, cfg)
    assert torch.equal(pos, expected), f"\n{pos}\n{expected}"
    assert delta == after[-1] + 1 - len(ids)
