"""MultiModalProcessor on Qwen3-VL: prompt ids and per-frame video features against HF's Qwen3VLProcessor."""

from __future__ import annotations

import pytest
import torch
from mm_media import encode_video, rand_image, rand_video

from vlserve.multimodal.media import load_video
from vlserve.multimodal.processor import MultiModalProcessor
from vlserve.multimodal.qwen3_vl_video import DEFAULT_TIMESTAMP_FPS, frame_hash, frame_timestamps

pytestmark = pytest.mark.hf_parity

MERGE = 2  # the tiny checkpoint's spatial merge size


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.support.qwen3_vl_checkpoints import build_qwen3_vl_checkpoint

    return build_qwen3_vl_checkpoint(str(tmp_path_factory.mktemp("qwen3_vl")))


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(ckpt)


@pytest.fixture
def proc(ckpt):
    return MultiModalProcessor.from_pretrained(ckpt)


def _chat(hf, parts: list[str], text: str = "Describe it.") -> str:
    content = [{"type": p} for p in parts] + [{"type": "text", "text": text}]
    return hf.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)


def _hf_call(hf, text: str, images=(), videos=()):
    """HF's own processing; `videos` holds (frames [T,H,W,3], fps or None, frame indices) per video."""
    from transformers.video_utils import VideoMetadata

    kw = {}
    if images:
        kw["images"] = list(images)
    if videos:
        kw["videos"] = [frames for frames, _, _ in videos]
        kw["video_metadata"] = [
            VideoMetadata(total_num_frames=len(frames), fps=fps, frames_indices=list(idx))
            for frames, fps, idx in videos
        ]
        kw["do_sample_frames"] = False
    from tests.support.qwen3_vl_checkpoints import trained_video_layout

    tok = hf.tokenizer
    special = [
        tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    ]
    return trained_video_layout(hf(text=[text], return_tensors="pt", **kw), *special)


def _ours(proc, text: str, images=(), videos=(), kwargs=None):
    prompt = proc.tokenizer(text, add_special_tokens=False)["input_ids"]
    return proc.process(prompt, images=list(images), videos=list(videos), mm_processor_kwargs=kwargs)


def _raw(frames):
    """HF's view of an in-memory clip as load_video keeps it: every frame, rate unknown (timestamps at 24 fps)."""
    return frames, DEFAULT_TIMESTAMP_FPS, range(len(frames))


def _check_videos(proc, ids, feats, ref):
    """Per-frame video features: HF's pixel rows in order, grids [1, h, w], each on a run of video pads."""
    vids = [f for f in feats if f.modality == "video"]
    torch.testing.assert_close(
        torch.cat([f.data["pixel_values_videos"] for f in vids]), ref["pixel_values_videos"], rtol=0, atol=0
    )
    assert sum(int(g[0]) for g in ref["video_grid_thw"]) == len(vids)
    start, end = (proc.tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    for f in vids:
        _, h, w = f.data["video_grid_thw"][0].tolist()
        assert f.data["video_grid_thw"].tolist() == [[1, h, w]] and f.data["video_grid_thw"].dtype == torch.int64
        assert f.data["pixel_values_videos"].shape[0] == h * w
        assert f.length == h * w // MERGE**2
        assert set(ids[f.offset : f.end]) == {proc.video_token_id}
        assert ids[f.offset - 1] == start and ids[f.end] == end
    assert sum(f.length for f in vids) == ids.count(proc.video_token_id)
    assert [f.offset for f in feats] == sorted(f.offset for f in feats)
    return vids


def test_timestamps_match_hf_arithmetic(hf):
    for indices, fps in (([0, 1, 2, 3], 24.0), ([0, 4, 7, 11, 15], 10.0), ([3], 2.0), ([0, 30, 61], 29.97)):
        assert frame_timestamps(indices, fps, 2) == hf._calculate_timestamps(list(indices), fps, 2)


def test_one_image_matches_hf(proc, hf):
    img = rand_image(64, 96, 1)
    text = _chat(hf, ["image"])
    ids, feats = _ours(proc, text, images=[img])
    ref = _hf_call(hf, text, images=[img])
    assert ids == ref["input_ids"][0].tolist()
    assert [f.modality for f in feats] == ["image"]
    torch.testing.assert_close(feats[0].data["pixel_values"], ref["pixel_values"], rtol=0, atol=0)
    assert feats[0].length == ids.count(proc.image_token_id) == int(ref["image_grid_thw"].prod()) // MERGE**2


def test_two_images_match_hf(proc, hf):
    images = [rand_image(64, 96, 2), rand_image(48, 80, 3)]
    text = _chat(hf, ["image", "image"], "Compare them.")
    ids, feats = _ours(proc, text, images=images)
    ref = _hf_call(hf, text, images=images)
    assert ids == ref["input_ids"][0].tolist()
    torch.testing.assert_close(torch.cat([f.data["pixel_values"] for f in feats]), ref["pixel_values"], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([f.data["image_grid_thw"] for f in feats]), ref["image_grid_thw"])


@pytest.mark.parametrize("num_frames", [4, 5])  # 5: HF pads the clip (and the timestamps) to a multiple of 2
def test_video_matches_hf(proc, hf, num_frames):
    frames = rand_video(num_frames, 64, 96, 4)
    text = _chat(hf, ["video"])
    ids, feats = _ours(proc, text, videos=[frames])
    ref = _hf_call(hf, text, videos=[_raw(frames)])
    assert ids == ref["input_ids"][0].tolist()
    vids = _check_videos(proc, ids, feats, ref)
    assert len(vids) == -(-num_frames // 2)
    video_hash = vids[0].mm_hash[: -len("-f0")]
    assert [f.mm_hash for f in vids] == [frame_hash(video_hash, j) for j in range(len(vids))]
    # HF's own default rate for clips without one is the constant ours falls back on
    assert _hf_call(hf, text, videos=[(frames, None, range(num_frames))])["input_ids"][0].tolist() == ids
    assert "<0.0 seconds>" in proc.tokenizer.decode(ids)


def test_image_and_video_in_one_prompt(proc, hf):
    img, frames = rand_image(48, 80, 5), rand_video(4, 48, 80, 6)
    text = _chat(hf, ["image", "video"], "What happens?")
    ids, feats = _ours(proc, text, images=[img], videos=[frames])
    ref = _hf_call(hf, text, images=[img], videos=[_raw(frames)])
    assert ids == ref["input_ids"][0].tolist()
    assert [f.modality for f in feats] == ["image", "video", "video"]
    torch.testing.assert_close(feats[0].data["pixel_values"], ref["pixel_values"], rtol=0, atol=0)
    _check_videos(proc, ids, feats, ref)


def test_decoded_video_uses_its_rate_and_frame_indices(proc, hf):
    data = encode_video(rand_video(12, 48, 80, 7), fps=10)
    loaded = load_video(data, num_frames=4)
    assert loaded.source_fps == pytest.approx(10.0) and loaded.frame_indices == [0, 4, 7, 11]
    text = _chat(hf, ["video"])
    ids, feats = _ours(proc, text, videos=[data], kwargs={"num_frames": 4})
    ref = _hf_call(hf, text, videos=[(loaded.frames, loaded.source_fps, loaded.frame_indices)])
    assert ids == ref["input_ids"][0].tolist()
    _check_videos(proc, ids, feats, ref)
    decoded = proc.tokenizer.decode(ids)
    assert "<0.2 seconds>" in decoded and "<0.9 seconds>" in decoded  # (0 + 0.4) / 2, (0.7 + 1.1) / 2


def test_repeated_video_hits_the_cache(proc, hf):
    frames = rand_video(4, 48, 80, 8)
    text = _chat(hf, ["video", "video"], "Same?")
    ids, feats = _ours(proc, text, videos=[frames, frames])
    assert (proc.cache_misses, proc.cache_hits) == (1, 1)
    ref = _hf_call(hf, text, videos=[_raw(frames), _raw(frames)])
    assert ids == ref["input_ids"][0].tolist()
    vids = _check_videos(proc, ids, feats, ref)
    assert [f.mm_hash for f in vids[:2]] == [f.mm_hash for f in vids[2:]]
    assert len({f.mm_hash for f in vids[:2]}) == 2
    again, feats2 = _ours(proc, text, videos=[frames, frames])
    assert again == ids and (proc.cache_misses, proc.cache_hits) == (1, 3)
    assert [f.mm_hash for f in feats2] == [f.mm_hash for f in feats]


@pytest.mark.parametrize(
    "as_array, num_frames, indices",
    [(False, None, [0, 1, 2, 3, 4, 5]), (True, None, [0, 1, 2, 3, 4, 5]), (False, 3, [0, 2, 5])],
)
def test_frames_given_at_a_rate_match_hf_with_that_fps(proc, hf, as_array, num_frames, indices):
    """Frames sent with mm_processor_kwargs fps=2 are a clip at 2 fps: HF given the same frames with
    video_metadata fps=2 (and the kept frames' indices) writes the timestamps ours must write."""
    frames = rand_video(6, 48, 80, 9)
    text = _chat(hf, ["video"])
    kwargs = {"fps": 2} if num_frames is None else {"fps": 2, "num_frames": num_frames}
    ids, feats = _ours(proc, text, videos=[frames if as_array else list(frames)], kwargs=kwargs)
    ref = _hf_call(hf, text, videos=[(frames[indices], 2.0, indices)])
    assert ids == ref["input_ids"][0].tolist()
    _check_videos(proc, ids, feats, ref)
    if num_frames is None:  # steps at (0 + 0.5) / 2, (1 + 1.5) / 2, (2 + 2.5) / 2 seconds
        assert all(f"<{t} seconds>" in proc.tokenizer.decode(ids) for t in ("0.2", "1.2", "2.2"))


def test_decoded_video_sampled_at_an_fps_matches_hf(proc, hf):
    data = encode_video(rand_video(12, 48, 80, 10), fps=10)
    loaded = load_video(data, fps=2)  # 1.2 s at 2 fps: 2 frames, timestamps at the file's 10 fps
    assert loaded.source_fps == pytest.approx(10.0) and loaded.frame_indices == [0, 11]
    text = _chat(hf, ["video"])
    ids, feats = _ours(proc, text, videos=[data], kwargs={"fps": 2})
    ref = _hf_call(hf, text, videos=[(loaded.frames, loaded.source_fps, loaded.frame_indices)])
    assert ids == ref["input_ids"][0].tolist()
    _check_videos(proc, ids, feats, ref)
