"""Media generators for the multimodal tests."""

from __future__ import annotations

import io

import numpy as np


def rand_image(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A random HxWx3 uint8 image."""
    return np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8)


def rand_video(t: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    """A random [T,H,W,3] uint8 clip."""
    return np.random.RandomState(seed).randint(0, 256, (t, h, w, 3), dtype=np.uint8)


def encode_video(frames: np.ndarray, fps: int = 10, codec: str = "mpeg4", fmt: str = "mp4") -> bytes:
    """Encode [T,H,W,3] uint8 frames into an in-memory video file with PyAV."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
