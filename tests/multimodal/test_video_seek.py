"""Video decoding by seeking: the same frames as decoding every frame in order, on clips of several codecs, GOPs
and containers (one whose stream carries no frame count, one with a variable frame rate, one that cannot seek
exactly), with fewer frames decoded; and frames scaled down as they are decoded."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from vlserve.multimodal import video_decode
from vlserve.multimodal.media import load_video
from vlserve.multimodal.video_decode import decode_frames, decode_sequential, fit_within_pixels, read_packet_table


def moving_clip(
    frames: int = 120,
    height: int = 72,
    width: int = 96,
    fps: int = 10,
    codec: str = "libx264",
    fmt: str = "mp4",
    gop: int = 12,
    frame_ms: list[int] | None = None,
) -> bytes:
    """A clip of a white square moving over a red ramp (every frame differs); `frame_ms`: each frame's pts in
    milliseconds (a variable frame rate) instead of `fps`."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = gop
        if frame_ms is not None:
            from fractions import Fraction

            stream.codec_context.time_base = Fraction(1, 1000)
        for i in range(frames):
            img = np.zeros((height, width, 3), np.uint8)
            img[:, :, 0] = (i * 2) % 256
            x = (i * 3) % (width - 10)
            img[10:20, x : x + 10] = 255
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            if frame_ms is not None:
                frame.pts = frame_ms[i]
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


class CountingContainer:
    """An input container that counts the seeks asked of it and the frames it decodes."""

    def __init__(self, data: bytes, log: dict):
        self.container, self.log = av.open(io.BytesIO(data)), log

    def __enter__(self) -> CountingContainer:
        return self

    def __exit__(self, *exc) -> None:
        self.container.close()

    @property
    def streams(self):
        return self.container.streams

    def demux(self, *args):
        return self.container.demux(*args)

    def seek(self, *args, **kwargs):
        self.log["seeks"] += 1
        return self.container.seek(*args, **kwargs)

    def decode(self, *args):
        for frame in self.container.decode(*args):
            self.log["decoded"] += 1
            yield frame


def counting(data: bytes) -> tuple[dict, object]:
    log = {"seeks": 0, "decoded": 0}
    return log, lambda: CountingContainer(data, log)


def assert_same_video(data: bytes, **sampling) -> None:
    """load_video seeking and decoding sequentially agree: same frame indices, same pixels, same timing."""
    seeking, sequential = load_video(data, **sampling), load_video(data, seek=False, **sampling)
    assert seeking.frame_indices == sequential.frame_indices
    assert np.array_equal(seeking.frames, sequential.frames)
    assert (seeking.num_source_frames, seeking.sampled_fps) == (sequential.num_source_frames, sequential.sampled_fps)


CLIPS = {
    "h264-mp4-bframes": dict(codec="libx264", fmt="mp4", gop=12),
    "mpeg4-mp4": dict(codec="mpeg4", fmt="mp4", gop=30),
    "vp8-webm-no-frame-count": dict(codec="libvpx", fmt="webm", gop=15),
    "h264-matroska": dict(codec="libx264", fmt="matroska", gop=20),
    "h264-mpegts": dict(codec="libx264", fmt="mpegts", gop=12),
}


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    return {name: moving_clip(**kw) for name, kw in CLIPS.items()}


@pytest.mark.parametrize("name", list(CLIPS))
@pytest.mark.parametrize("sampling", [{"num_frames": 7}, {"fps": 1.0}, {"num_frames": 2}, {}, {"max_frames": 40}])
def test_seeking_keeps_the_sequential_frames(clips, name, sampling):
    assert_same_video(clips[name], **sampling)


@pytest.mark.parametrize("name", ["h264-mp4-bframes", "mpeg4-mp4", "vp8-webm-no-frame-count", "h264-matroska"])
def test_far_apart_frames_are_reached_by_seeking(clips, name):
    """Five frames 30 apart in a clip with a keyframe at least every 30: a seek per gap, far fewer frames decoded
    than the 120 the sequential path goes through, and the same pixels."""
    log, open_container = counting(clips[name])
    table = read_packet_table(open_container)
    assert table.seekable and table.num_frames == 120
    indices = [0, 30, 60, 90, 119]
    frames, kept = decode_frames(open_container, indices, table=table)
    assert kept == indices and log["seeks"] >= 3
    assert log["decoded"] < 100
    ref_frames, ref_kept = decode_sequential(lambda: av.open(io.BytesIO(clips[name])), indices)
    assert ref_kept == kept and np.array_equal(frames, ref_frames)


def test_dense_frames_inside_one_gop_decode_on_without_seeking():
    """A GOP longer than the gaps between the wanted frames: no seek at all (each keyframe is behind the frames
    already decoded), and only the frames up to the last wanted one are decoded."""
    data = moving_clip(frames=90, codec="mpeg4", gop=90)
    log, open_container = counting(data)
    table = read_packet_table(open_container)
    assert table.keyframe_indices == [0]  # a single keyframe: the first frame
    frames, kept = decode_frames(open_container, [0, 10, 20, 30, 40], table=table)
    assert kept == [0, 10, 20, 30, 40] and log == {"seeks": 0, "decoded": 41}
    assert_same_video(data, num_frames=5)


def test_a_stream_without_frame_count_is_counted_by_its_packets(clips):
    data = clips["vp8-webm-no-frame-count"]
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.video[0].frames == 0
    video = load_video(data, num_frames=4)
    assert video.num_source_frames == 120 and video.frame_indices == [0, 40, 79, 119]


def test_variable_frame_rate_frames_are_named_by_their_pts():
    """Irregular gaps between frames (pts in ms): frame i is still the i-th frame decoded, whichever path."""
    rng = np.random.RandomState(0)
    frame_ms = np.cumsum(rng.randint(20, 400, size=80)).tolist()
    for fmt in ("matroska", "mp4"):
        data = moving_clip(frames=80, codec="libx264", fmt=fmt, gop=10, frame_ms=frame_ms)
        table = read_packet_table(lambda data=data: av.open(io.BytesIO(data)))
        assert table.seekable and table.num_frames == 80
        assert len(set(np.diff(table.frame_pts).tolist())) > 10  # the gaps really vary
        assert_same_video(data, num_frames=9)
        assert_same_video(data, fps=1.0)


def test_a_seek_that_overshoots_falls_back_to_sequential_decoding(clips):
    """A container whose seeks land past the wanted frame: the clip is decoded in order instead, same frames."""
    data = clips["h264-mp4-bframes"]
    table = read_packet_table(lambda: av.open(io.BytesIO(data)))

    class Overshooting(CountingContainer):
        def seek(self, offset, **kwargs):
            self.log["seeks"] += 1
            return self.container.seek(table.frame_pts[table.keyframe_indices[-1]], **kwargs)

    log = {"seeks": 0, "decoded": 0}
    frames, kept = decode_frames(lambda: Overshooting(data, log), [0, 60], table=table)
    ref_frames, ref_kept = decode_sequential(lambda: av.open(io.BytesIO(data)), [0, 60])
    assert log["seeks"] == 1 and kept == ref_kept == [0, 60] and np.array_equal(frames, ref_frames)
    # a table naming a frame that is no keyframe as one: the demuxer lands on the keyframe before it
    wrong = video_decode.PacketTable(table.num_frames, table.frame_pts, [0, 59])
    frames, kept = decode_frames(lambda: av.open(io.BytesIO(data)), [0, 60], table=wrong)
    assert kept == [0, 60] and np.array_equal(frames, ref_frames)


def test_packets_without_usable_pts_are_decoded_in_order():
    table = video_decode.PacketTable(5, [], [])
    assert not table.seekable
    data = moving_clip(frames=20, codec="mpeg4", gop=5)
    log, open_container = counting(data)
    frames, kept = decode_frames(open_container, [0, 19], table=table)
    assert kept == [0, 19] and log == {"seeks": 0, "decoded": 20}


def test_fit_within_pixels():
    size = fit_within_pixels(1280 * 720)
    assert size(720, 1280) == (720, 1280) and size(100, 50) == (100, 50)
    h, w = size(1080, 1920)
    assert h * w <= 1280 * 720 and abs(w / h - 16 / 9) < 0.01
    h, w = size(4000, 3)
    assert h * w <= 1280 * 720 and w >= 1


def test_frames_are_scaled_down_as_decoded(clips):
    """Frames over the bound come out at the bound's size, both paths alike; frames under it as decoded."""
    data = moving_clip(frames=40, height=144, width=256, codec="libx264", gop=8)
    small = fit_within_pixels(64 * 36)
    video = load_video(data, num_frames=5, frame_size=small)
    assert video.frames.shape == (5, 36, 64, 3)
    sequential = load_video(data, num_frames=5, frame_size=small, seek=False)
    assert np.array_equal(video.frames, sequential.frames)
    full = load_video(data, num_frames=5)
    assert full.frames.shape == (5, 144, 256, 3)
    roomy = load_video(data, num_frames=5, frame_size=fit_within_pixels(144 * 256))
    assert np.array_equal(roomy.frames, full.frames)  # not over the bound: untouched
    # the square is still where it was: the scaled frame is the full one, smaller
    full_small = np.stack(
        [np.asarray(av.VideoFrame.from_ndarray(f).reformat(64, 36).to_ndarray()) for f in full.frames]
    )
    assert np.abs(video.frames.astype(int) - full_small.astype(int)).mean() < 12
