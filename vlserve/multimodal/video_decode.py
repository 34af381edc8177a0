"""PyAV decoding of a video's sampled frames, in bounded time and memory.

Frames are named by index: the i-th frame the decoder outputs (presentation order). `read_packet_table` demuxes the
stream without decoding to learn each frame's presentation timestamp (pts) and where the keyframes are; with it,
`decode_frames` seeks to the keyframe at or before each wanted frame whenever that skips enough frames past those
already decoded (`SEEK_MIN_SKIPPED_FRAMES`), and otherwise decodes on. Without a usable table (packets without pts,
duplicate pts, discarded packets) it decodes every frame in order. Both ways return the same frames: a seek that
lands anywhere but at or before the wanted pts, or a wanted pts the decoder never outputs, sends the whole clip
through the sequential path.

Frames are converted to RGB as they are decoded, each at the size `frame_size(height, width)` names (scaled by
swscale, bicubic), so a large source never sits in memory at full resolution; the kept frames fill one array.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

FrameSize = Callable[[int, int], tuple[int, int]]  # (height, width) decoded -> (height, width) kept
OpenContainer = Callable[[], Any]  # a fresh av.container.InputContainer on the same input


def fit_within_pixels(max_pixels: int) -> FrameSize:
    """A FrameSize that scales a frame of more than `max_pixels` pixels down to fit within it, aspect kept."""

    def size(height: int, width: int) -> tuple[int, int]:
        if height * width <= max_pixels:
            return height, width
        scale = math.sqrt(max_pixels / (height * width))
        return max(1, math.floor(height * scale)), max(1, math.floor(width * scale))

    return size


# A seek (demuxer seek, decoder flush and restart) costs about what decoding 2-3 frames does (640x360 H.264 here):
# it is worth it when it skips at least this many frames.
SEEK_MIN_SKIPPED_FRAMES = 4


@dataclass(frozen=True)
class PacketTable:
    """What demuxing the first video stream tells without decoding: its frame count (packets with data) and, when
    every frame can be named by its pts, the pts of each frame index and which indices are keyframes."""

    num_frames: int
    frame_pts: list[int]  # frame index -> pts (ascending); empty when frames cannot be named by pts
    keyframe_indices: list[int]  # ascending

    @property
    def seekable(self) -> bool:
        return bool(self.keyframe_indices) and len(self.frame_pts) == self.num_frames

    def keyframe_before(self, index: int) -> int | None:
        """The index of the last keyframe at or before frame `index` (None: none is)."""
        i = bisect.bisect_right(self.keyframe_indices, index)
        return self.keyframe_indices[i - 1] if i else None


def read_packet_table(open_container: OpenContainer) -> PacketTable:
    """Demux (no decoding) the first video stream of a fresh container into a PacketTable."""
    num_frames, pts, keyframe_pts, nameable = 0, [], [], True
    with open_container() as container:
        for packet in container.demux(container.streams.video[0]):
            if not packet.size:  # the demuxer's end-of-stream marker
                continue
            num_frames += 1
            if packet.pts is None or packet.is_discard:  # a frame the decoder drops or cannot be named
                nameable = False
                continue
            pts.append(packet.pts)
            if packet.is_keyframe:
                keyframe_pts.append(packet.pts)
    pts.sort()
    if not nameable or len(set(pts)) != len(pts):
        return PacketTable(num_frames, [], [])
    return PacketTable(num_frames, pts, sorted(bisect.bisect_left(pts, k) for k in keyframe_pts))


class _SeekMiss(Exception):
    """Seeking did not land where the table said: the caller decodes sequentially instead."""


class _FrameStore:
    """The kept frames, converted as decoded into one preallocated [k, H, W, 3] uint8 array."""

    def __init__(self, capacity: int, frame_size: FrameSize | None):
        self.capacity, self.frame_size = capacity, frame_size
        self.frames: np.ndarray | None = None
        self.indices: list[int] = []

    def add(self, index: int, frame: Any) -> None:
        height, width = frame.height, frame.width
        out_h, out_w = self.frame_size(height, width) if self.frame_size is not None else (height, width)
        if (out_h, out_w) == (height, width):
            rgb = frame.to_ndarray(format="rgb24")  # [H, W, 3] uint8
        else:
            rgb = frame.reformat(width=out_w, height=out_h, format="rgb24", interpolation="BICUBIC").to_ndarray()
        if self.frames is None:
            self.frames = np.empty((self.capacity, *rgb.shape), np.uint8)
        elif rgb.shape != self.frames.shape[1:]:
            raise ValueError(
                f"video frames change size mid-stream: {self.frames.shape[2]}x{self.frames.shape[1]} "
                f"then {rgb.shape[1]}x{rgb.shape[0]}"
            )
        self.frames[len(self.indices)] = rgb
        self.indices.append(index)

    def result(self) -> tuple[np.ndarray, list[int]]:
        if self.frames is None:
            raise ValueError("video has no decodable frames")
        n = len(self.indices)
        return (self.frames if n == self.capacity else self.frames[:n].copy()), self.indices


def decode_frames(
    open_container: OpenContainer,
    indices: list[int],
    frame_size: FrameSize | None = None,
    table: PacketTable | None = None,
) -> tuple[np.ndarray, list[int]]:
    """The frames at `indices` (ascending) of the first video stream -> ([k, H, W, 3] uint8, indices decoded).

    Seeks when `table` is given and seekable, else decodes in order; indices past the stream's end are left out.
    """
    if table is not None and table.seekable:
        try:
            return _decode_seeking(open_container, indices, frame_size, table)
        except _SeekMiss:
            pass
    return decode_sequential(open_container, indices, frame_size)


def decode_sequential(
    open_container: OpenContainer, indices: list[int], frame_size: FrameSize | None = None
) -> tuple[np.ndarray, list[int]]:
    """Decode every frame up to the last wanted one, converting only the wanted ones."""
    wanted, last = set(indices), indices[-1]
    store = _FrameStore(len(indices), frame_size)
    with open_container() as container:
        for i, frame in enumerate(container.decode(container.streams.video[0])):
            if i in wanted:
                store.add(i, frame)
            if i >= last:
                break
    return store.result()


def _decode_seeking(
    open_container: OpenContainer, indices: list[int], frame_size: FrameSize | None, table: PacketTable
) -> tuple[np.ndarray, list[int]]:
    store = _FrameStore(len(indices), frame_size)
    with open_container() as container:
        stream = container.streams.video[0]
        frames: Iterator[Any] | None = None
        position = -1  # index of the last frame decoded
        for index in indices:
            if index >= table.num_frames:
                break
            keyframe = table.keyframe_before(index)
            skipped = -1 if keyframe is None else keyframe - position - 1  # frames a seek to it would skip
            if skipped >= SEEK_MIN_SKIPPED_FRAMES:
                container.seek(table.frame_pts[keyframe], backward=True, any_frame=False, stream=stream)
                frames = None
            if frames is None:
                frames = container.decode(stream)
            _decode_to(frames, table.frame_pts[index], store, index)
            position = index
    return store.result()


def _decode_to(frames: Iterator[Any], target: int, store: _FrameStore, index: int) -> None:
    """Decode on to the frame whose pts is `target` and keep it as frame `index`."""
    for frame in frames:
        if frame.pts is None or frame.pts > target:
            raise _SeekMiss  # landed past the wanted frame, or the decoder's pts are not the packets'
        if frame.pts == target:
            store.add(index, frame)
            return
    raise _SeekMiss  # the decoder ended before the wanted frame
