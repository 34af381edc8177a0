"""`VideoStream`: the prompt of a live video session, grown one frame pair at a time (no engine calls here).

A session's prompt is `head + video + tail`: `head` is the chat template's text up to the video placeholder, `tail`
the rest of the question turn. The video is a list of chunks, one per temporal grid step (a pair of frames for
temporal_patch_size 2), each run through the checkpoint's own HF video processor when it arrives and carried as its
own media item. Qwen2-VL / Qwen2.5-VL chunks are bare placeholder runs whose `video_time_offset` makes M-RoPE give
them the positions of the same steps in one whole-video item (`multimodal/mrope.py`); Qwen3-VL chunks are the
per-frame runs with timestamp text its processor writes (`multimodal/qwen3_vl_video.py`). An odd frame waits for its
pair; a question asked meanwhile carries it padded (its last frame repeated, as the processor pads a whole video).

A chunk's mm_hash is its pixels' content hash (with the processor kwargs) plus its index in the session: the tower's
output depends on the pixels alone, but equal pairs at different times (a still camera) must stay distinct items of
one request. The window (`max_frames`, less `window_slack` when it overflows) drops the oldest chunks; the kept ones
then count time from 0, as in one request carrying the window's frames, while their mm_hashes (and cached
embeddings) stay the same. The window's items carry the session's id (`MultiModalFeature.session_id`; not the padded
chunk, which is one question's own), so that an engine process is sent their data once (`session_media`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from vlserve.engine.input_processor import ProcessedPrompt
from vlserve.multimodal.hashing import hash_mm_item
from vlserve.multimodal.inputs import MultiModalFeature
from vlserve.multimodal.media import LoadedVideo
from vlserve.multimodal.processor import MultiModalProcessor

# the frame rate timestamps (Qwen3-VL) and second_per_grid_ts (Qwen2.5-VL) derive from
DEFAULT_SESSION_FPS = 2.0


@dataclass
class VideoChunk:
    """One temporal grid step of the stream: its frames and processed data (kept while in the window, so the
    tower can run again if the encoder cache dropped its embeddings)."""

    index: int  # the chunk's place in the whole session (never reused)
    frames: np.ndarray  # [temporal_patch, H, W, 3] uint8
    content_hash: str
    data: dict[str, Any] = field(repr=False)  # pixel_values_videos [h*w, C*tp*p*p], video_grid_thw [1, 3], ...
    num_real: int = 0  # frames that are the stream's, not padding (0: all of them)

    @property
    def mm_hash(self) -> str:
        return f"{self.content_hash}-s{self.index}"


def frames_array(frames: Any) -> np.ndarray:
    """A list of HxWx3 uint8 arrays / PIL images (or one [T, H, W, 3] array) -> [T, H, W, 3] uint8; ValueError for
    anything else."""
    if isinstance(frames, np.ndarray) and frames.ndim == 4:
        items = list(frames)
    elif isinstance(frames, (list, tuple)):
        items = [np.asarray(f.convert("RGB")) if hasattr(f, "convert") else np.asarray(f) for f in frames]
    else:
        raise ValueError("frames must be a list of HxWx3 uint8 arrays or PIL images, or a [T, H, W, 3] array")
    if not items:
        raise ValueError("append needs at least one frame")
    for i, f in enumerate(items):
        if f.dtype != np.uint8 or f.ndim != 3 or f.shape[2] != 3:
            raise ValueError(f"frame {i} must be an HxWx3 uint8 array, got {f.dtype} {tuple(f.shape)}")
    if len({f.shape for f in items}) != 1:
        raise ValueError(f"all frames of a session must have one size; got {sorted({f.shape for f in items})}")
    return np.stack(items)  # [T, H, W, 3]


class VideoStream:
    """The growing video of one session and the prompts built from it (see the module docstring)."""

    def __init__(
        self,
        mm_processor: MultiModalProcessor,
        fps: float,
        max_frames: int,
        mm_processor_kwargs: dict | None = None,
        window_slack: int = 0,
        session_id: str | None = None,
    ):
        if mm_processor is None or mm_processor.video_processor is None:
            raise ValueError("this model takes no video; a video session needs a model with a video processor")
        if mm_processor.family is not None and mm_processor.qwen3_videos is None:
            raise ValueError("video sessions serve the Qwen2-VL, Qwen2.5-VL and Qwen3-VL families")
        self.mm_processor = mm_processor
        self.session_id = session_id  # marks the window's items (`MultiModalFeature.session_id`)
        self.temporal_patch = int(getattr(mm_processor.video_processor, "temporal_patch_size", 2))
        if not fps > 0:
            raise ValueError(f"fps must be positive, got {fps}")
        if max_frames < self.temporal_patch:
            raise ValueError(f"the window must hold at least {self.temporal_patch} frames, got {max_frames}")
        self.fps = float(fps)
        self.max_frames = int(max_frames)
        if not 0 <= window_slack <= max_frames - self.temporal_patch:
            raise ValueError(
                f"window_slack must be in [0, {max_frames - self.temporal_patch}] (max_frames - one pair), "
                f"got {window_slack}"
            )
        # an overflowing window drops down to max_frames - window_slack frames, so that the prefix's positions
        # restart (and its KV is recomputed) once every window_slack frames rather than at every append
        self.window_slack = int(window_slack)
        _, self.video_kwargs, sampling = MultiModalProcessor._split_kwargs(mm_processor_kwargs)
        if sampling:
            raise ValueError(f"a session's frames are not sampled; drop {sorted(sampling)} (use fps / max_frames)")
        self.chunks: list[VideoChunk] = []
        self.pending: np.ndarray | None = None  # [k < temporal_patch, H, W, 3]: frames waiting for their pair
        self.frame_size: tuple[int, ...] | None = None
        self.next_index = 0
        self.frames_seen = 0
        self.released: list[str] = []  # mm_hashes no prompt of this stream will carry again (dropped, padded ones)

    # -- frames ------------------------------------------------------------------------------------------------
    def append(self, frames: Any) -> bool:
        """Add frames (processed pair by pair, the oldest dropped beyond the window); True when the prefix (the
        head and the whole chunks) changed, so that its KV is worth computing."""
        new = frames_array(frames)
        max_pixels = self.mm_processor.max_image_pixels
        if max_pixels is not None and new.shape[1] * new.shape[2] > max_pixels:
            raise ValueError(f"frames of {new.shape[2]}x{new.shape[1]} exceed the {max_pixels}-pixel limit")
        if self.frame_size is None:
            self.frame_size = new.shape[1:]
        elif new.shape[1:] != self.frame_size:
            raise ValueError(f"frames of {new.shape[1:]} differ from the session's {self.frame_size}")
        self.frames_seen += len(new)
        if self.pending is not None:
            new = np.concatenate([self.pending, new])
        whole = len(new) - len(new) % self.temporal_patch
        for start in range(0, whole, self.temporal_patch):
            self.chunks.append(self._chunk(new[start : start + self.temporal_patch]))
        self.pending = new[whole:] if whole < len(new) else None
        if self.num_frames > self.max_frames:
            while self.num_frames > self.max_frames - self.window_slack:
                self.released.append(self.chunks.pop(0).mm_hash)
        return whole > 0

    def snapshot(self) -> tuple:
        """What `restore` takes back to (an append that fails leaves the stream as it was)."""
        return list(self.chunks), self.pending, self.frame_size, self.next_index, self.frames_seen, list(self.released)

    def restore(self, state: tuple) -> None:
        chunks, self.pending, self.frame_size, self.next_index, self.frames_seen, released = state
        self.chunks, self.released = list(chunks), list(released)

    @property
    def num_frames(self) -> int:
        """Frames in the window: the whole chunks' and the one waiting for its pair."""
        pending = 0 if self.pending is None else len(self.pending)
        return len(self.chunks) * self.temporal_patch + pending

    def take_released(self) -> list[str]:
        """The mm_hashes released since the last call (every chunk's, after `close`)."""
        released, self.released = self.released, []
        return released

    def close(self) -> None:
        """Release every chunk and the waiting frames."""
        self.released.extend(c.mm_hash for c in self.chunks)
        self.chunks.clear()
        self.pending = None

    def window_frames(self) -> np.ndarray:
        """[num_frames, H, W, 3]: the frames a question sees, oldest first."""
        parts = [c.frames for c in self.chunks] + ([self.pending] if self.pending is not None else [])
        return np.concatenate(parts)

    def _chunk(self, frames: np.ndarray) -> VideoChunk:
        """Run one temporal step's frames through the HF video processor (the code a whole video goes through)."""
        index = self.next_index
        self.next_index += 1
        video = LoadedVideo(frames, self.fps, self.fps, list(range(len(frames))), len(frames))
        data = self.mm_processor._run_video(video, self.video_kwargs, {"fps": self.fps})
        if int(data["video_grid_thw"][0][0]) != 1:
            raise ValueError(f"a chunk of {len(frames)} frames gave {data['video_grid_thw'].tolist()} grid steps")
        content_hash = hash_mm_item("video", frames, {**self.video_kwargs, "fps": self.fps})
        return VideoChunk(index, frames, content_hash, data)

    # -- prompts -----------------------------------------------------------------------------------------------
    def video_run(self, with_pending: bool) -> tuple[list[int], list[MultiModalFeature]]:
        """The video's token ids and items (offsets from the video's start): the window's chunks, and with
        `with_pending` the waiting frames padded into one more chunk."""
        chunks = list(self.chunks)
        if with_pending and self.pending is not None:
            pad = np.concatenate([self.pending] + [self.pending[-1:]] * (self.temporal_patch - len(self.pending)))
            saved = self.next_index
            chunks.append(replace(self._chunk(pad), num_real=len(self.pending)))
            self.next_index = saved  # the padded chunk is the question's own, not the stream's
            self.released.append(chunks[-1].mm_hash)
        ids: list[int] = []
        features: list[MultiModalFeature] = []
        for step, chunk in enumerate(chunks):
            mm_hash = chunk.mm_hash
            session_id = None if chunk.num_real else self.session_id  # the padded chunk is the question's own
            if self.mm_processor.qwen3_videos is not None:
                run, feats = self._qwen3_run(mm_hash, chunk, step, offset=len(ids))
                if session_id is not None:
                    feats = [replace(f, session_id=session_id) for f in feats]
            else:
                num = int(chunk.data["video_grid_thw"][0].prod()) // self.mm_processor._merge_size("video") ** 2
                run = [self.mm_processor.video_token_id] * num
                data = {**chunk.data, "video_time_offset": step}
                feats = [MultiModalFeature("video", mm_hash, len(ids), num, data, session_id)]
            ids.extend(run)
            features.extend(feats)
        return ids, features

    def _qwen3_run(self, mm_hash: str, chunk: VideoChunk, step: int, offset: int):
        """Qwen3-VL: timestamp text, `<|vision_start|>`, the pads, `<|vision_end|>`; frame indices count from the
        window's first frame, as in one request carrying the window's frames."""
        first = step * self.temporal_patch
        data = {
            **chunk.data,
            # a padded chunk's timestamp is its real frames' (the processor pads the indices with the last one)
            "frame_indices": list(range(first, first + (chunk.num_real or self.temporal_patch))),
            "timestamp_fps": self.fps,
        }
        run, feats = self.mm_processor.qwen3_videos.expand(mm_hash, data, offset)
        return run, [replace(f, mm_hash=mm_hash) for f in feats]

    def prompt(self, head: list[int], tail: list[int] | None) -> ProcessedPrompt:
        """`head + video (+ tail)`: with `tail` None the prefix of whole chunks (what is prefilled as the stream
        grows), else a question's prompt (waiting frames included)."""
        ids, features = self.video_run(with_pending=tail is not None)
        for f in features:
            f.offset += len(head)
        return ProcessedPrompt(None, head + ids + list(tail or []), features)
