"""Loading of user-supplied media: images (PIL/path/bytes/array/data URL) and videos (frames/array/path/bytes).

Everything that can go wrong with untrusted input (corrupt or truncated bytes, zero-size images, decompression
bombs, unsupported types, undecodable videos) is reported as a ValueError whose message names the problem, so the
API layer can turn it into a 400 response.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import numbers
import os
import stat
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vlserve.multimodal.video_decode import FrameSize, decode_frames, read_packet_table
from vlserve.shorten import shorten

DEFAULT_MAX_IMAGE_PIXELS = 64_000_000  # 64 megapixels: larger images are rejected before they are decoded
DEFAULT_MAX_VIDEO_FRAMES = 256  # frames kept from one video after sampling
# PyAV demuxers of still-image formats: such input in a video part is refused, not read as a one-frame video.
_IMAGE_DEMUXERS = ("image2", "image2pipe")


_GENERIC_MIMES = ("", "application/octet-stream")  # no claim about the content: it is sniffed when decoded


def _decode_data_url(url: str, kind: str) -> bytes:
    """Return the payload of a `data:<mime>;base64,<payload>` URL whose MIME type fits `kind` (image/video)."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise ValueError("malformed data URL: missing ',' between header and payload")
    if not header.endswith(";base64"):
        raise ValueError("unsupported data URL: only ';base64' payloads are accepted")
    mime = header[len("data:") :].split(";", 1)[0].strip().lower()
    if mime not in _GENERIC_MIMES and not mime.startswith(f"{kind}/"):
        raise ValueError(
            f"a data URL of type {shorten(mime)} was given where {kind} data is expected; "
            f"send data:{kind}/<format>;base64,..."
        )
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"malformed data URL: invalid base64 payload ({e})") from None


def _check_local_file(path: str, kind: str) -> None:
    """ValueError unless `path` names an existing regular file (directories, FIFOs and devices are refused)."""
    if "\x00" in path:
        raise ValueError(f"{kind} path {shorten(path)} contains a NUL character")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ValueError(f"{kind} file not found: {shorten(path, 200)}") from None
    except OSError as e:
        raise ValueError(f"cannot read {kind} file {shorten(path, 200)}: {e.strerror}") from None
    if stat.S_ISDIR(mode):
        raise ValueError(f"{kind} path {shorten(path, 200)} is a directory, not a file")
    if not stat.S_ISREG(mode):
        raise ValueError(f"{kind} path {shorten(path, 200)} is not a regular file (a FIFO, socket or device)")


def _source_bytes_or_path(x: Any, kind: str) -> bytes | str:
    """Normalize str/Path/bytes/data-URL inputs to raw bytes or an existing file path."""
    if isinstance(x, (bytes, bytearray, memoryview)):
        data = bytes(x)
        if not data:
            raise ValueError(f"empty {kind} bytes")
        return data
    if isinstance(x, Path):
        x = str(x)
    if isinstance(x, str):
        if x.startswith("data:"):
            data = _decode_data_url(x, kind)
            if not data:
                raise ValueError(f"empty {kind} data URL payload")
            return data
        if x.startswith(("http://", "https://")):
            raise ValueError(f"remote {kind} URLs are not fetched here; download it first: {shorten(x, 80)}")
        if x.startswith("file://"):
            x = x[len("file://") :]
        _check_local_file(x, kind)
        return x
    raise ValueError(f"unsupported {kind} input type: {type(x).__name__}")


def _check_size(width: int, height: int, max_pixels: int | None, what: str = "image") -> None:
    if width <= 0 or height <= 0:
        raise ValueError(f"{what} has zero size ({width}x{height})")
    if max_pixels is not None and width * height > max_pixels:
        raise ValueError(
            f"{what} too large: {width}x{height} = {width * height} pixels exceeds the cap of {max_pixels} pixels"
        )


def _to_rgb(img: Image.Image) -> Image.Image:
    """Convert any PIL mode to RGB; transparent images are composited on a white background."""
    if img.mode == "RGB":
        return img
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        # High bit-depth grayscale: scale to 8 bits instead of letting PIL clip.
        arr = np.asarray(img, dtype=np.float64)
        hi = float(arr.max()) if arr.size else 0.0
        arr = arr / hi * 255.0 if hi > 255 else arr
        img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), mode="L")
    return img.convert("RGB")


def _image_from_array(arr: np.ndarray, max_pixels: int | None) -> Image.Image:
    """HxW, HxWx1, HxWx3 or HxWx4 uint8 array -> PIL image."""
    if arr.dtype == np.bool_:
        arr = arr.astype(np.uint8) * 255
    if arr.dtype != np.uint8:
        raise ValueError(f"image array must have dtype uint8, got {arr.dtype}")
    if arr.ndim == 3 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    if arr.ndim == 2:
        _check_size(arr.shape[1], arr.shape[0], max_pixels)
        return Image.fromarray(np.ascontiguousarray(arr), mode="L")
    if arr.ndim == 3 and arr.shape[-1] in (3, 4):
        _check_size(arr.shape[1], arr.shape[0], max_pixels)
        return Image.fromarray(np.ascontiguousarray(arr), mode="RGB" if arr.shape[-1] == 3 else "RGBA")
    raise ValueError(f"image array must have shape HxW, HxWx1, HxWx3 or HxWx4, got {tuple(arr.shape)}")


def load_image(x: Any, max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Load one image from a PIL image, file path, bytes, uint8 array or base64 data URL; return it as RGB.

    Raises ValueError for corrupt/truncated/unrecognized data, zero-size images, images with more than
    `max_pixels` pixels (checked from the header, before decoding) and unsupported input types.
    """
    if isinstance(x, Image.Image):
        _check_size(x.width, x.height, max_pixels)
        try:
            return _to_rgb(x)
        except (OSError, SyntaxError) as e:
            raise ValueError(f"could not decode image: {e}") from None
    if isinstance(x, np.ndarray):
        return _to_rgb(_image_from_array(x, max_pixels))
    src = _source_bytes_or_path(x, "image")
    fp = io.BytesIO(src) if isinstance(src, bytes) else src
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(fp)  # lazy: reads only the header
        except Image.DecompressionBombError as e:
            raise ValueError(f"image too large (decompression bomb): {e}") from None
        except Image.UnidentifiedImageError:  # its message names an in-memory object by address
            raise ValueError(
                "could not decode image: the data is not in an image format Pillow reads (PNG, JPEG, "
                "GIF, WebP, BMP, ...)"
            ) from None
        except (OSError, SyntaxError, ValueError) as e:
            raise ValueError(f"could not decode image: {e}") from None
        try:
            _check_size(img.width, img.height, max_pixels)
            img.load()
            return _to_rgb(img)
        except ValueError:
            raise
        except Image.DecompressionBombError as e:
            raise ValueError(f"image too large (decompression bomb): {e}") from None
        except (OSError, SyntaxError, EOFError, IndexError, struct.error) as e:
            raise ValueError(f"could not decode image (corrupt or truncated data): {e}") from None


@dataclass
class LoadedVideo:
    """Decoded and sampled video frames plus the timing facts the processor needs."""

    frames: np.ndarray  # [T, H, W, 3] uint8
    source_fps: float | None  # rate of the input frames `frame_indices` count in (None when unknown)
    sampled_fps: float | None  # frame rate of `frames` after sampling (None when unknown)
    frame_indices: list[int]  # indices of the kept frames in the source
    num_source_frames: int


def sample_frame_indices(
    total: int, source_fps: float | None, fps: float | None, num_frames: int | None, max_frames: int
) -> list[int]:
    """Uniformly choose frame indices: `num_frames` of them, or as many as `fps` needs, capped at `max_frames`."""
    if total <= 0:
        raise ValueError("video has no decodable frames")
    if num_frames is not None and fps is not None:
        raise ValueError("pass either fps or num_frames for video sampling, not both")
    if num_frames is not None:
        if num_frames <= 0:
            raise ValueError(f"num_frames must be positive, got {num_frames}")
        k = num_frames
    elif fps is not None and source_fps:
        if fps <= 0:
            raise ValueError(f"fps must be positive, got {fps}")
        k = max(1, math.floor(total / source_fps * fps))
    else:
        k = total
    k = max(1, min(k, total, max_frames))
    return np.linspace(0, total - 1, k).round().astype(np.int64).tolist()


def _frames_from_sequence(x: Any, max_pixels: int | None) -> np.ndarray:
    """List of frames or [T,H,W,(3|4)] / [T,H,W] array -> [T,H,W,3] uint8."""
    if isinstance(x, np.ndarray):
        if x.ndim not in (3, 4):
            raise ValueError(f"video array must have shape [T,H,W] or [T,H,W,C], got {tuple(x.shape)}")
        x = list(x)
    if len(x) == 0:
        raise ValueError("video has no frames")
    frames = [np.asarray(load_image(f, max_pixels=max_pixels)) for f in x]
    shape = frames[0].shape
    for i, f in enumerate(frames):
        if f.shape != shape:
            raise ValueError(f"video frames differ in size: frame 0 is {shape[:2]}, frame {i} is {f.shape[:2]}")
    return np.stack(frames)


def _decode_video(
    src: bytes | str,
    fps: float | None,
    num_frames: int | None,
    max_frames: int,
    max_pixels: int | None,
    frame_size: FrameSize | None = None,
    seek: bool = True,
) -> LoadedVideo:
    import av

    def open_container():
        return av.open(io.BytesIO(src) if isinstance(src, bytes) else src)

    try:
        with open_container() as container:
            fmt = container.format.name or ""
            if fmt in _IMAGE_DEMUXERS or fmt.endswith("_pipe"):
                raise ValueError(f"a video was expected but the data is a still image ({fmt}); send it as an image")
            if not container.streams.video:
                raise ValueError("no video stream in the input")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            source_fps = float(rate) if rate else None
            if stream.codec_context.width and stream.codec_context.height:
                _check_size(stream.codec_context.width, stream.codec_context.height, max_pixels, "video frame")
            total = stream.frames
        table = None
        if seek or not total:
            try:
                table = read_packet_table(open_container)
            except av.FFmpegError:
                if not total:
                    raise
        total = total or table.num_frames  # Matroska / WebM carry no frame count: their packets are counted
        indices = sample_frame_indices(total, source_fps, fps, num_frames, max_frames)
        frames, kept = decode_frames(open_container, indices, frame_size, table if seek else None)
    except (av.FFmpegError, OSError, EOFError) as e:  # checked first: PyAV errors also subclass ValueError
        raise ValueError(f"could not decode video: {e}") from None
    sampled = source_fps * len(kept) / total if source_fps else None
    return LoadedVideo(frames, source_fps, sampled, kept, total)


def load_video(
    x: Any,
    fps: float | None = None,
    num_frames: int | None = None,
    max_frames: int = DEFAULT_MAX_VIDEO_FRAMES,
    source_fps: float | None = None,
    max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
    frame_size: FrameSize | None = None,
    seek: bool = True,
) -> LoadedVideo:
    """Load and uniformly sample a video from a list of frames, a [T,H,W,3] array, a file path, bytes or data URL.

    `fps` samples that many frames per second of video, `num_frames` a fixed count (uniformly spread); with neither,
    all frames are kept. At most `max_frames` frames are kept. For pre-decoded frames `source_fps` gives their rate;
    when it is unknown and `fps` is given, the frames are taken as already sampled at `fps`: that is their rate.
    The returned `sampled_fps` is what Qwen2.5-VL's second_per_grid_ts derives from.
    A video file is decoded by seeking to the sampled frames (`seek=False`: by decoding every frame up to the last
    one; both give the same frames, see video_decode), each kept at `frame_size(height, width)` (default: as is).
    """
    if isinstance(x, LoadedVideo):
        return x
    for name, rate in (("fps", fps), ("source_fps", source_fps)):
        if rate is not None and (
            isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0 < rate < math.inf
        ):
            raise ValueError(f"{name} must be a positive finite number, got {shorten(rate)}")
    if isinstance(x, (list, tuple, np.ndarray)):
        all_frames = _frames_from_sequence(x, max_pixels)
        total = len(all_frames)
        indices = sample_frame_indices(total, source_fps, fps if source_fps else None, num_frames, max_frames)
        rate = source_fps or fps  # without a source rate, the frames were given at `fps`
        sampled = rate * len(indices) / total if rate else None
        return LoadedVideo(all_frames[indices], rate, sampled, indices, total)
    src = _source_bytes_or_path(x, "video")
    return _decode_video(src, fps, num_frames, max_frames, max_pixels, frame_size, seek)
