"""load_image / load_video: accepted inputs, mode conversion, rejections, frame sampling."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from mm_media import encode_video, rand_image, rand_video
from PIL import Image

from vlserve.multimodal.media import LoadedVideo, load_image, load_video, sample_frame_indices


def _png_bytes(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def test_image_inputs_all_agree(tmp_path):
    arr = rand_image(20, 30)
    pil = Image.fromarray(arr)
    data = _png_bytes(pil)
    path = tmp_path / "x.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    for src in (pil, arr, data, bytearray(data), str(path), path, url):
        img = load_image(src)
        assert img.mode == "RGB" and img.size == (30, 20)
        np.testing.assert_array_equal(np.asarray(img), arr)


def test_grayscale_array_and_modes():
    gray = np.full((4, 5), 77, np.uint8)
    assert np.asarray(load_image(gray)).tolist() == [[[77] * 3] * 5] * 4
    assert load_image(gray[..., None]).mode == "RGB"
    cmyk = Image.new("CMYK", (3, 2), (0, 0, 0, 0))  # no ink = white
    assert np.asarray(load_image(cmyk)).min() == 255
    pal = Image.new("RGB", (3, 3), (10, 200, 30)).convert("P", palette=Image.Palette.ADAPTIVE)
    np.testing.assert_array_equal(np.asarray(load_image(pal))[0, 0], [10, 200, 30])
    i16 = Image.fromarray(np.full((2, 2), 1000, np.uint16))
    assert load_image(i16).mode == "RGB"


def test_rgba_composited_on_white():
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (255, 0, 0, 255)  # opaque red
    rgba[1, 1] = (0, 0, 255, 128)  # half-transparent blue
    out = np.asarray(load_image(rgba)).astype(int)
    assert out[0, 0].tolist() == [255, 0, 0]
    assert out[0, 1].tolist() == [255, 255, 255]  # fully transparent -> white
    assert abs(out[1, 1][0] - 127) <= 1 and out[1, 1][2] == 255
    # A palette image with a transparent index goes through the same path.
    pal = Image.fromarray(rgba[..., :3]).convert("P")
    pal.info["transparency"] = 0
    assert load_image(pal).mode == "RGB"


@pytest.mark.parametrize(
    "bad, msg",
    [
        (b"not an image at all", "could not decode"),
        (b"", "empty"),
        ("data:image/png;base64,%%%%", "base64"),
        ("data:image/png,abc", "base64"),
        ("/definitely/not/here.png", "not found"),
        ("http://example.com/a.png", "remote"),
        (12345, "unsupported image input type"),
        (np.zeros((4, 4, 3), np.float32), "uint8"),
        (np.zeros((4, 4, 2), np.uint8), "shape"),
        (np.zeros((0, 4, 3), np.uint8), "zero size"),
    ],
)
def test_image_rejections(bad, msg):
    with pytest.raises(ValueError, match=msg):
        load_image(bad)


def test_unidentified_image_message_names_no_python_object():
    with pytest.raises(ValueError) as info:
        load_image(b"\x89PNG\r\n\x1a\n" + b"this is not a picture" * 8)
    message = str(info.value)
    assert "not in an image format" in message and "0x" not in message and "_io" not in message


def test_truncated_image_rejected():
    data = _png_bytes(Image.fromarray(rand_image(64, 64)))
    with pytest.raises(ValueError, match="corrupt or truncated|could not decode"):
        load_image(data[: len(data) // 2])
    jpg = _png_bytes(Image.fromarray(rand_image(64, 64)), "JPEG")
    with pytest.raises(ValueError, match="corrupt or truncated|could not decode"):
        load_image(jpg[: len(jpg) // 3])


def test_pixel_cap_checked_before_decode(monkeypatch):
    big = _png_bytes(Image.new("RGB", (300, 200)))
    with pytest.raises(ValueError, match="too large"):
        load_image(big, max_pixels=300 * 200 - 1)
    assert load_image(big, max_pixels=300 * 200).size == (300, 200)
    # The cap is enforced from the header: decoding must never start.
    monkeypatch.setattr(Image.Image, "load", lambda self: (_ for _ in ()).throw(AssertionError("decoded")))
    with pytest.raises(ValueError, match="too large"):
        load_image(big, max_pixels=1000)


def test_sample_frame_indices():
    assert sample_frame_indices(10, None, None, None, 100) == list(range(10))
    assert sample_frame_indices(10, None, None, 4, 100) == [0, 3, 6, 9]
    assert sample_frame_indices(10, None, None, None, 5) == [0, 2, 4, 7, 9]
    assert len(sample_frame_indices(90, 30.0, 2.0, None, 100)) == 6  # 3 s at 2 fps
    assert sample_frame_indices(3, 30.0, 2.0, None, 100) == [0]  # at least one frame
    with pytest.raises(ValueError, match="not both"):
        sample_frame_indices(10, 30.0, 2.0, 4, 100)
    with pytest.raises(ValueError, match="no decodable frames"):
        sample_frame_indices(0, None, None, None, 100)


def test_video_from_arrays_and_frames():
    clip = rand_video(8, 12, 16)
    v = load_video(clip)
    assert isinstance(v, LoadedVideo) and v.frames.shape == (8, 12, 16, 3) and v.frames.dtype == np.uint8
    np.testing.assert_array_equal(v.frames, clip)
    assert v.sampled_fps is None
    v = load_video([Image.fromarray(f) for f in clip], num_frames=4)
    np.testing.assert_array_equal(v.frames, clip[[0, 2, 5, 7]])
    v = load_video(clip, fps=2.0)  # unknown source rate: frames are taken as sampled at 2 fps
    assert v.sampled_fps == 2.0 and len(v.frames) == 8
    assert v.source_fps == 2.0 and v.frame_indices == list(range(8))  # the rate their indices count in
    v = load_video(clip, fps=2.0, num_frames=4)  # 4 of the frames given at 2 fps
    assert (v.source_fps, v.sampled_fps, v.frame_indices) == (2.0, 1.0, [0, 2, 5, 7])
    for bad in (0, -2.0, float("nan"), float("inf"), "2", True):
        with pytest.raises(ValueError, match="fps must be a positive finite number"):
            load_video(clip, fps=bad)
    with pytest.raises(ValueError, match="source_fps must be a positive finite number"):
        load_video(clip, source_fps=-1.0)
    v = load_video(clip, fps=2.0, source_fps=8.0)  # 1 s of video at 2 fps
    assert len(v.frames) == 2 and v.sampled_fps == pytest.approx(2.0)
    with pytest.raises(ValueError, match="differ in size"):
        load_video([clip[0], clip[1][:6]])
    with pytest.raises(ValueError, match="no frames"):
        load_video([])


def test_video_decode_with_pyav(tmp_path):
    clip = np.zeros((20, 32, 48, 3), np.uint8)
    for i in range(20):
        clip[i, :, :, 0] = i * 12  # brightness ramp: lets us check which frames were kept
    data = encode_video(clip, fps=10)
    v = load_video(data)
    assert v.frames.shape == (20, 32, 48, 3) and v.source_fps == pytest.approx(10.0)
    assert v.sampled_fps == pytest.approx(10.0) and v.num_source_frames == 20
    v = load_video(data, fps=2.0)  # 2 s at 2 fps -> 4 frames spread over the clip
    assert len(v.frames) == 4 and v.sampled_fps == pytest.approx(2.0)
    assert v.frame_indices == [0, 6, 13, 19]
    red = v.frames[:, :, :, 0].mean(axis=(1, 2))
    assert np.all(np.diff(red) > 30)  # increasing ramp -> frames are in order and spread out
    v = load_video(data, num_frames=5)
    assert len(v.frames) == 5
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    assert load_video(str(path), num_frames=3).frames.shape == (3, 32, 48, 3)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    assert load_video(url, max_frames=2).frames.shape[0] == 2
    # Matroska/WebM streams carry no frame count: the loader counts packets instead.
    webm = load_video(encode_video(clip[:9], fps=3, codec="libvpx", fmt="webm"), num_frames=3)
    assert webm.num_source_frames == 9 and webm.frame_indices == [0, 4, 8]


def test_video_rejections():
    with pytest.raises(ValueError, match="could not decode video|no video stream|no decodable"):
        load_video(b"garbage bytes that are not a video container" * 10)
    data = encode_video(rand_video(6, 16, 16), fps=5)
    with pytest.raises(ValueError):
        load_video(data[: len(data) // 4])
    with pytest.raises(ValueError, match="unsupported video input type"):
        load_video(3.5)
