"""Frames kept at the size the video processor uses: a Qwen2-VL clip larger than its processor's target is decoded
straight to that target (same grid, same token count as the full-size frames), a smaller one is untouched (same
pixel values, same tokens); other processors get the server's pixel cap; and the server's frame cap."""

from __future__ import annotations

import numpy as np
import pytest

from tests.multimodal.test_video_seek import moving_clip
from vlserve.multimodal.media import load_video
from vlserve.multimodal.video_frame_size import qwen2_vl_frame_size, video_frame_size


@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint
    from vlserve.multimodal.processor import MultiModalProcessor

    return MultiModalProcessor.from_pretrained(build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("frame_size"))))


def full_size(proc, data: bytes, video_kwargs: dict, num_frames: int) -> dict:
    """The processor's output for the clip's frames decoded at full size (what it saw before frames were cut)."""
    video = load_video(data, num_frames=num_frames)
    return proc.process_video(video, video_kwargs, {"num_frames": num_frames})[1]


def test_a_small_clip_is_untouched_and_processed_exactly_as_before(proc):
    data = moving_clip(frames=16, height=84, width=112, codec="libx264", gop=4)  # 9408 px < 50176
    loaded = proc._load_video(data, {"num_frames": 4}, 256, {})
    assert loaded.frames.shape == (4, 84, 112, 3)
    _, data_out = proc.process_video(data, {}, {"num_frames": 4})
    ref = full_size(proc, data, {}, 4)
    assert data_out["video_grid_thw"].tolist() == ref["video_grid_thw"].tolist()
    assert np.array_equal(data_out["pixel_values_videos"].numpy(), ref["pixel_values_videos"].numpy())


@pytest.mark.parametrize(
    "shape, video_kwargs",
    [
        ((360, 640), {}),
        ((480, 360), {}),
        ((720, 1280), {}),
        ((360, 640), {"max_pixels": 16 * 28 * 28}),
        ((360, 640), {"min_pixels": 16 * 28 * 28, "max_pixels": 16 * 28 * 28}),  # the demo model's bounds
        ((288, 352), {"min_pixels": 16 * 28 * 28, "max_pixels": 16 * 28 * 28}),
    ],
)
def test_a_large_clip_is_decoded_smaller_with_the_same_grid(proc, shape, video_kwargs):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    height, width = shape
    data = moving_clip(frames=12, height=height, width=width, codec="libx264", gop=4)
    loaded = proc._load_video(data, {"num_frames": 4}, 256, video_kwargs)
    bounds = {"min_pixels": video_kwargs.get("min_pixels", 3136), "max_pixels": video_kwargs.get("max_pixels", 50176)}
    kept = loaded.frames.shape[1:3]
    assert loaded.frames.shape[0] == 4 and kept[0] * kept[1] < height * width / 2
    assert smart_resize(*kept, 28, **bounds) == smart_resize(height, width, 28, **bounds)
    _, out = proc.process_video(data, video_kwargs, {"num_frames": 4})
    ref = full_size(proc, data, video_kwargs, 4)
    assert out["video_grid_thw"].tolist() == ref["video_grid_thw"].tolist()  # same token count
    # the same picture: normalized pixels close to those resized from the full-size frames
    diff = (out["pixel_values_videos"] - ref["pixel_values_videos"]).abs().mean().item()
    assert diff < 0.05


def test_the_rule_applies_only_where_it_is_exact(proc):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    vp = proc.video_processor
    exact = qwen2_vl_frame_size(vp, {})
    assert exact(1080, 1920) == smart_resize(1080, 1920, 28, min_pixels=3136, max_pixels=50176)
    assert exact(84, 112) == (84, 112)
    assert exact(3, 2000) == (3, 2000)  # an aspect ratio the processor refuses: left to it
    assert qwen2_vl_frame_size(vp, {"do_resize": False}) is None  # a kwarg the rule does not model
    assert qwen2_vl_frame_size(object(), {}) is None
    capped = video_frame_size(object(), {}, 1280 * 720)  # another processor: the server's cap
    h, w = capped(1080, 1920)
    assert h * w <= 1280 * 720 and capped(720, 1280) == (720, 1280)
    assert video_frame_size(object(), {}, None) is None
    generic = video_frame_size(vp, {"do_resize": False}, 1000)
    assert generic(100, 100)[0] * generic(100, 100)[1] <= 1000


def test_other_processors_get_the_server_pixel_cap(proc, monkeypatch):
    import vlserve.multimodal.processor as processor_module

    monkeypatch.setattr(processor_module, "video_frame_size", lambda vp, kw, cap: video_frame_size(None, kw, cap))
    monkeypatch.setattr(proc, "max_video_frame_pixels", 64 * 48)
    data = moving_clip(frames=8, height=144, width=192, codec="mpeg4", gop=4)
    assert proc._load_video(data, {"num_frames": 2}, 256, {}).frames.shape == (2, 48, 64, 3)


def test_the_frame_cap_bounds_fps_sampling_and_is_the_api_bound(tmp_path):
    from types import SimpleNamespace

    from vlserve.api.errors import APIError
    from vlserve.api.media_controls import MediaIOControls
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint
    from vlserve.multimodal.processor import MultiModalProcessor

    small = MultiModalProcessor.from_pretrained(build_qwen2_vl_checkpoint(str(tmp_path)), max_video_frames=6)
    data = moving_clip(frames=40, height=56, width=56, fps=10, codec="mpeg4", gop=8)  # 4 s
    _, out = small.process_video(data, {}, {"fps": 5.0})  # 20 frames asked, 6 kept
    assert int(out["video_grid_thw"][0, 0]) == 3  # 6 frames / temporal patch 2
    engine = SimpleNamespace(input_processor=SimpleNamespace(mm_processor=small), engine_args=SimpleNamespace())
    engine.engine_args.mm_processor_kwargs = None
    controls = MediaIOControls.from_engine(engine)
    assert controls.max_frames == 6
    assert controls.merge({"video": {"num_frames": 6}}, None)["num_frames"] == 6
    with pytest.raises(APIError, match="num_frames may be at most 6"):
        controls.merge({"video": {"num_frames": 7}}, None)


def test_the_flags_reach_engine_args():
    from vlserve.cli import build_parser, serve_config_from_args
    from vlserve.config import EngineArgs
    from vlserve.engine.mm_setup import video_limits_from_args

    argv = ["serve", "--max-video-frames", "32", "--max-video-frame-pixels", "921600"]
    args, _ = serve_config_from_args(build_parser().parse_args(argv))
    assert (args.max_video_frames, args.max_video_frame_pixels) == (32, 921600)
    assert video_limits_from_args(args) == {"max_video_frames": 32, "max_video_frame_pixels": 921600}
    args, _ = serve_config_from_args(build_parser().parse_args(["serve"]))
    assert video_limits_from_args(args) == {}
    with pytest.raises(ValueError, match="max_video_frames must be an integer >= 1"):
        EngineArgs(model=None, max_video_frames=0)


def test_the_api_process_frontend_gets_the_video_bounds(tmp_path):
    """`vlserve serve` with the engine in its own process loads the processor in the API process (load_frontend)."""
    from vlserve.config import EngineArgs
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint
    from vlserve.engine.mp_async_llm import load_frontend

    ckpt = build_qwen2_vl_checkpoint(str(tmp_path))
    args = EngineArgs(model=ckpt, max_video_frames=5, max_video_frame_pixels=4096)
    mm_processor = load_frontend(ckpt, args)[2]
    assert (mm_processor.max_video_frames, mm_processor.max_video_frame_pixels) == (5, 4096)
