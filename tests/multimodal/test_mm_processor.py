"""MultiModalProcessor: parity with the HF processor's own __call__, per-item caching, errors."""

from __future__ import annotations

import pytest
import torch
from mm_media import encode_video, rand_image, rand_video
from PIL import Image

from vlserve.multimodal.processor import MultiModalProcessor

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
VID = "<|vision_start|><|video_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def hf_processors(qwen2_vl_dir, qwen2_5_vl_dir):
    from transformers import AutoProcessor

    return {d: AutoProcessor.from_pretrained(d) for d in (qwen2_vl_dir, qwen2_5_vl_dir)}


@pytest.fixture
def hf_proc(vl_dir, hf_processors):
    return hf_processors[vl_dir]


def _ids(hf_proc, text: str) -> list[int]:
    return hf_proc.tokenizer(text).input_ids


def test_checkpoint_loads_offline(vl_dir, hf_proc):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(vl_dir)
    tok = hf_proc.tokenizer
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>") == hf_proc.image_token_id
    assert cfg.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>") == hf_proc.video_token_id
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    text = hf_proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what color?"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert IMG in text and text.endswith("<|im_start|>assistant\n")


def test_images_match_hf_call(hf_proc):
    images = [rand_image(60, 90, 1), Image.fromarray(rand_image(120, 40, 2)), rand_image(30, 30, 3)]
    prompt = f"<|im_start|>user\nfirst {IMG} then {IMG}and{IMG} which one?<|im_end|>\n"
    kwargs = {"max_pixels": 28 * 28 * 12}
    proc = MultiModalProcessor(hf_proc)
    new_ids, feats = proc.process(_ids(hf_proc, prompt), images=images, mm_processor_kwargs=kwargs)
    ref = hf_proc(text=[prompt], images=images, return_tensors="pt", **kwargs)
    assert new_ids == ref["input_ids"][0].tolist()
    assert [f.modality for f in feats] == ["image"] * 3
    torch.testing.assert_close(torch.cat([f.data["pixel_values"] for f in feats]), ref["pixel_values"], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([f.data["image_grid_thw"] for f in feats]), ref["image_grid_thw"])
    for f in feats:
        assert f.length == int(f.data["image_grid_thw"].prod()) // 4
        assert set(new_ids[f.offset : f.end]) == {hf_proc.image_token_id}
        assert new_ids[f.offset - 1] == hf_proc.tokenizer.convert_tokens_to_ids("<|vision_start|>")
        assert new_ids[f.end] == hf_proc.tokenizer.convert_tokens_to_ids("<|vision_end|>")
    assert len({f.mm_hash for f in feats}) == 3


def test_mixed_images_and_videos_match_hf_call(hf_proc):
    images = [rand_image(56, 84, 4), rand_image(50, 70, 5)]
    videos = [rand_video(4, 40, 60, 6), rand_video(5, 56, 56, 7)]  # odd frame count: HF pads the last frame
    prompt = f"a {VID} b {IMG} c {VID}{IMG} d"
    proc = MultiModalProcessor(hf_proc)
    new_ids, feats = proc.process(_ids(hf_proc, prompt), images=images, videos=videos, mm_processor_kwargs={"fps": 1.0})
    ref = hf_proc(text=[prompt], images=images, videos=videos, fps=1.0, return_tensors="pt")
    assert new_ids == ref["input_ids"][0].tolist()
    assert [f.modality for f in feats] == ["video", "image", "video", "image"]
    assert [f.offset for f in feats] == sorted(f.offset for f in feats)
    vids = [f for f in feats if f.modality == "video"]
    torch.testing.assert_close(
        torch.cat([f.data["pixel_values_videos"] for f in vids]), ref["pixel_values_videos"], rtol=0, atol=0
    )
    torch.testing.assert_close(torch.cat([f.data["video_grid_thw"] for f in vids]), ref["video_grid_thw"])
    imgs = [f for f in feats if f.modality == "image"]
    torch.testing.assert_close(torch.cat([f.data["pixel_values"] for f in imgs]), ref["pixel_values"], rtol=0, atol=0)
    from tests.support.hf_generate import transformers_major

    # Qwen2.5-VL; transformers 5.x's processor ignores fps for raw frames (it assumes 24 fps), 4.x honours it
    if "second_per_grid_ts" in ref and transformers_major() < 5:
        assert [float(f.data["second_per_grid_ts"]) for f in vids] == pytest.approx(ref["second_per_grid_ts"])
    assert all(float(f.data["second_per_grid_ts"]) == 2.0 for f in vids)  # temporal_patch 2 / 1 fps


def test_video_bytes_fps_sampling(hf_proc):
    clip = rand_video(20, 56, 112, 8)
    data = encode_video(clip, fps=10)  # 2 s of video
    proc = MultiModalProcessor(hf_proc)
    ids, feats = proc.process(_ids(hf_proc, f"x {VID} y"), videos=[data], mm_processor_kwargs={"fps": 2.0})
    (f,) = feats
    assert f.data["video_grid_thw"].tolist() == [[2, 4, 8]]  # 4 frames -> grid_t 2; 56x112 -> 4x8 patches
    assert f.length == 2 * 4 * 8 // 4
    assert float(f.data["second_per_grid_ts"]) == pytest.approx(1.0)  # 2 frames per grid step at 2 fps
    _, feats4 = proc.process(_ids(hf_proc, f"x {VID} y"), videos=[data], mm_processor_kwargs={"num_frames": 8})
    assert feats4[0].data["video_grid_thw"][0, 0] == 4 and feats4[0].mm_hash != f.mm_hash
    assert float(feats4[0].data["second_per_grid_ts"]) == pytest.approx(2 / 4.0)  # 8 frames over 2 s


class _CountingProcessor:
    """Wraps an HF image processor and counts its calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_cache_hits_skip_hf_processor(hf_proc):
    proc = MultiModalProcessor(hf_proc, cache_size=2)
    proc.image_processor = spy = _CountingProcessor(hf_proc.image_processor)
    img = rand_image(40, 40, 9)
    prompt = _ids(hf_proc, f"q {IMG} r")
    _, f1 = proc.process(prompt, images=[img])
    _, f2 = proc.process(prompt, images=[Image.fromarray(img.copy())])  # same pixels, other container
    assert spy.calls == 1 and proc.cache_hits == 1 and proc.cache_misses == 1
    assert f1[0].mm_hash == f2[0].mm_hash and f2[0].data["pixel_values"] is f1[0].data["pixel_values"]
    _, f3 = proc.process(prompt, images=[img], mm_processor_kwargs={"max_pixels": 28 * 28 * 4})
    assert spy.calls == 2 and f3[0].mm_hash != f1[0].mm_hash  # kwargs are part of the key
    proc.process(prompt, images=[rand_image(40, 40, 10)])  # third entry evicts the LRU one (f1's)
    proc.process(prompt, images=[img])
    assert spy.calls == 4 and proc.cache_hits == 1


def test_placeholder_count_mismatch(hf_proc):
    proc = MultiModalProcessor(hf_proc)
    with pytest.raises(ValueError, match=r"2 image placeholder.*1 images"):
        proc.process(_ids(hf_proc, f"{IMG}{IMG}"), images=[rand_image(30, 30)])
    with pytest.raises(ValueError, match=r"0 video placeholder.*1 videos"):
        proc.process(_ids(hf_proc, "text only"), videos=[rand_video(2, 30, 30)])
    with pytest.raises(ValueError, match="could not decode"):
        proc.process(_ids(hf_proc, IMG), images=[b"junk"])
    with pytest.raises(ValueError, match="image processing failed"):
        proc.process(_ids(hf_proc, IMG), images=[rand_image(30, 30)], mm_processor_kwargs={"min_pixels": "x"})
    with pytest.raises(ValueError, match="aspect ratio"):
        proc.process(_ids(hf_proc, IMG), images=[rand_image(3, 900)])


def test_text_only_and_video_pixel_kwargs(hf_proc):
    proc = MultiModalProcessor(hf_proc)
    ids = _ids(hf_proc, "hello world")
    assert proc.process(ids) == (ids, [])
    # min/max_pixels also bound video frames (translated into the video processor's `size`).
    _, (small,) = proc.process(
        _ids(hf_proc, VID), videos=[rand_video(2, 112, 112)], mm_processor_kwargs={"max_pixels": 28 * 28 * 4}
    )
    assert small.data["video_grid_thw"].tolist() == [[1, 4, 4]]
    assert proc.max_image_embeds() == 64 and proc.max_video_embeds(8) == 4 * 64


def test_cache_byte_bound(hf_proc):
    img_a, img_b = rand_image(56, 56, 11), rand_image(56, 56, 12)
    prompt = _ids(hf_proc, IMG)
    one = MultiModalProcessor(hf_proc)._nbytes(MultiModalProcessor(hf_proc).process(prompt, images=[img_a])[1][0].data)
    proc = MultiModalProcessor(hf_proc, cache_max_bytes=one + one // 2)  # room for one item only
    proc.process(prompt, images=[img_a])
    proc.process(prompt, images=[img_b])  # evicts a
    proc.process(prompt, images=[img_b])
    proc.process(prompt, images=[img_a])
    assert proc.cache_hits == 1 and proc.cache_misses == 3 and proc._cache_bytes == one
