"""A tiny Qwen2-VL server started with --max-video-frames: a request asking for more frames is a 400 naming the cap,
one within it is served; and a video is decoded in the preprocessing pool, never on the event loop."""

from __future__ import annotations

import asyncio
import base64
import threading

import openai
import pytest

from tests.multimodal.test_video_seek import moving_clip

ENGINE_KW = dict(dtype="float32", max_model_len=2048, num_kv_blocks=256, block_size=16, max_num_seqs=4)
MAX_FRAMES = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.api.conftest import start_server
    from vlserve.config import EngineArgs
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    ckpt = build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("video_limits_vl")))
    s = start_server(EngineArgs(model=ckpt, served_model_name="tiny-vl", max_video_frames=MAX_FRAMES, **ENGINE_KW))
    yield s
    s.close()


def video_chat(served, clip: bytes, **media_io_kwargs):
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "what moves?"}]
    extra = {"ignore_eos": True}
    if media_io_kwargs:
        extra["media_io_kwargs"] = {"video": media_io_kwargs}
    return served.client.chat.completions.create(
        model="tiny-vl", messages=[{"role": "user", "content": content}], max_tokens=2, extra_body=extra
    )


def test_the_frame_cap_is_the_bound_on_num_frames(served):
    clip = moving_clip(frames=20, height=56, width=56, codec="mpeg4", gop=5)
    with pytest.raises(openai.BadRequestError) as err:
        video_chat(served, clip, num_frames=MAX_FRAMES + 1)
    assert f"media_io_kwargs.video.num_frames may be at most {MAX_FRAMES}" in str(err.value)
    ok = video_chat(served, clip, num_frames=MAX_FRAMES)
    assert ok.usage.completion_tokens == 2
    many = video_chat(served, clip, fps=10.0)  # all 20 frames asked by rate: sampled down to the cap
    assert many.usage.prompt_tokens == ok.usage.prompt_tokens


def test_videos_are_decoded_off_the_event_loop(served, monkeypatch):
    import vlserve.multimodal.processor as processor_module

    calls: list[tuple[str, bool]] = []
    inner = processor_module.load_video

    def recording(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        calls.append((threading.current_thread().name, on_loop))
        return inner(*args, **kwargs)

    monkeypatch.setattr(processor_module, "load_video", recording)
    video_chat(served, _fresh_clip())
    assert calls, "the video was not decoded through load_video"
    for thread_name, on_loop in calls:
        assert not on_loop and thread_name != threading.main_thread().name
        assert thread_name.startswith("vlserve-preprocess")


def _fresh_clip() -> bytes:
    """A clip no earlier test sent (the processor cache would answer without decoding)."""
    return moving_clip(frames=14, height=56, width=70, codec="mpeg4", gop=7)
