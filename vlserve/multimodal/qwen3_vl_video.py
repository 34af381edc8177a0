"""Qwen3-VL's video prompts: one `<|video_pad|>` becomes, for every temporal grid step j (a pair of frames), the text
`<{t_j:.1f} seconds>`, then `<|vision_start|>`, h*w/merge**2 pad tokens and `<|vision_end|>`.

t_j is the mean time (frame index / fps) of the first and last source frame of step j; the index list is padded
with its last entry up to a multiple of the temporal patch size first, as the video processor pads the frames.
MultiModalProcessor (processor.py) hands each processed video here and gets back the expanded token ids plus one
MultiModalFeature per grid step (the vision tower encodes the frames of a Qwen3-VL video independently).
Images follow the Qwen2-VL grid rules and do not come here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vlserve.multimodal.inputs import MultiModalFeature
from vlserve.multimodal.video_pruning import frame_keep_counts, pruned_mm_hash, pruned_video_data

# The frame rate HF's Qwen3-VL processor assumes for timestamps when a video's own rate is unknown
# (pre-decoded frames given without an fps).
DEFAULT_TIMESTAMP_FPS = 24.0
# Bound on the memo of tokenized timestamp strings (one entry per distinct "<x.y seconds>").
_MAX_MEMO = 4096


def is_qwen3_vl_processor(hf_processor: Any) -> bool:
    """Whether the HF processor is Qwen3VLProcessor (Qwen3-VL and Qwen3-VL-MoE). Matched by class name: several
    other families define their own `_calculate_timestamps` with other rules, so that method is no signal."""
    return type(hf_processor).__name__ == "Qwen3VLProcessor"


def timestamp_fps(source_fps: float | None) -> float:
    """The frame rate timestamps are computed with: the video's own rate, else DEFAULT_TIMESTAMP_FPS."""
    return float(source_fps) if source_fps else DEFAULT_TIMESTAMP_FPS


def frame_timestamps(frame_indices: Sequence[int], fps: float, temporal_patch: int) -> list[float]:
    """Seconds of each temporal grid step: the mean of the times of its first and last frame."""
    indices = [int(i) for i in frame_indices]
    indices += indices[-1:] * (-len(indices) % temporal_patch)  # pad like the frames: repeat the last one
    seconds = [i / fps for i in indices]
    return [(seconds[k] + seconds[k + temporal_patch - 1]) / 2 for k in range(0, len(seconds), temporal_patch)]


def frame_hash(video_hash: str, step: int) -> str:
    """mm_hash of grid step `step` of a video (a deterministic suffix on the video's own content hash)."""
    return f"{video_hash}-f{step}"


class Qwen3VLVideos:
    """Builds the per-frame token runs and features of Qwen3-VL videos for one HF processor. Thread-safe (the memo
    of tokenized timestamps is a plain dict whose worst race is tokenizing a string twice)."""

    def __init__(self, hf_processor: Any) -> None:
        tok = hf_processor.tokenizer
        self.tokenizer = tok
        self.video_token_id = int(hf_processor.video_token_id)
        self.vision_start_id = int(
            tok.convert_tokens_to_ids(getattr(hf_processor, "vision_start_token", "<|vision_start|>"))
        )
        self.vision_end_id = int(tok.convert_tokens_to_ids(getattr(hf_processor, "vision_end_token", "<|vision_end|>")))
        video_processor = hf_processor.video_processor
        self.temporal_patch = int(getattr(video_processor, "temporal_patch_size", 2))
        self.merge_size = int(getattr(video_processor, "merge_size", 2))
        self._memo: dict[str, list[int]] = {}

    @staticmethod
    def timing(video: Any) -> dict:
        """The facts timestamps derive from, for a LoadedVideo: kept in its processed data and folded into its
        mm_hash (two sampled clips with equal pixels can sit at different times)."""
        return {
            "timestamp_fps": timestamp_fps(video.source_fps),
            "frame_indices": [int(i) for i in video.frame_indices],
        }

    def _text_ids(self, text: str) -> list[int]:
        ids = self._memo.get(text)
        if ids is None:
            # Tokenized on its own: in the prompt it sits between special tokens, which split pre-tokenization.
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if len(self._memo) < _MAX_MEMO:
                self._memo[text] = ids
        return ids

    def placeholder_span(self, ids: list[int], pos: int) -> tuple[int, int]:
        """`[start, end)` of the prompt tokens one video replaces: the `<|vision_start|><|video_pad|><|vision_end|>`
        the chat template writes when the pad at `pos` sits inside one (every frame brings its own pair: the layout
        Qwen3-VL was trained on, as transformers 4.57 writes it; 5.x keeps the outer pair too), else the pad alone."""
        if 0 < pos < len(ids) - 1 and ids[pos - 1] == self.vision_start_id and ids[pos + 1] == self.vision_end_id:
            return pos - 1, pos + 2
        return pos, pos + 1

    def expand(
        self, video_hash: str, data: dict, offset: int, pruning_rate: float = 0.0
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """One processed video (processor.py's cached data plus `timing`) -> (the token ids replacing its single
        placeholder, one "video" feature per grid step with offsets counted from `offset`). With a pruning rate
        every step after the first holds its `frame_keep_counts` share of placeholders (video_pruning.py)."""
        import torch

        grid_t, grid_h, grid_w = (int(x) for x in data["video_grid_thw"][0])
        rows = grid_h * grid_w  # patch rows of one grid step in pixel_values_videos
        num = rows // self.merge_size**2  # embeddings of one grid step
        seconds = frame_timestamps(data["frame_indices"], data["timestamp_fps"], self.temporal_patch)
        if len(seconds) != grid_t:
            raise ValueError(f"video has {grid_t} temporal grid steps but {len(seconds)} frame timestamps")
        pixels = data["pixel_values_videos"]  # [grid_t*grid_h*grid_w, C*temporal_patch*patch*patch]
        merged = (1, grid_h // self.merge_size, grid_w // self.merge_size)  # one step's merged grid
        counts = frame_keep_counts(num, grid_t, pruning_rate) if pruning_rate else [num] * grid_t
        ids: list[int] = []
        features: list[MultiModalFeature] = []
        previous = None  # the previous step's pixel rows
        for j, sec in enumerate(seconds):
            ids.extend(self._text_ids(f"<{sec:.1f} seconds>"))
            ids.append(self.vision_start_id)
            frame = {
                # [grid_h*grid_w, C*temporal_patch*patch*patch]; cloned so that pickling one frame's data does not
                # carry the whole video's storage along
                "pixel_values_videos": pixels[j * rows : (j + 1) * rows].clone(),
                "video_grid_thw": torch.tensor([[1, grid_h, grid_w]], dtype=torch.int64),  # [1, 3]
            }
            mm_hash = frame_hash(video_hash, j)
            if pruning_rate and j:  # the first step is kept whole: the unpruned item
                pixel_rows = frame["pixel_values_videos"]
                frame = pruned_video_data(frame, pruning_rate, merged, counts[j], previous)
                mm_hash, previous = pruned_mm_hash(mm_hash, pruning_rate), pixel_rows
            else:
                previous = frame["pixel_values_videos"]
            if counts[j]:  # (a step pruned to nothing keeps its timestamp and vision tokens, no item)
                features.append(
                    MultiModalFeature(
                        modality="video", mm_hash=mm_hash, offset=offset + len(ids), length=counts[j], data=frame
                    )
                )
            ids.extend([self.video_token_id] * counts[j])
            ids.append(self.vision_end_id)
        return ids, features

    def expand_video(
        self, video_hash: str, data: dict, ids: list[int], pos: int, pruning_rate: float = 0.0
    ) -> tuple[int, int, list[int], list[MultiModalFeature]]:
        """The video placeholder at `ids[pos]` -> (start, end, run, features): `ids[start:end]` becomes `run`, the
        features' offsets counted from the start of `run` (MultiModalProcessor.process's video seam)."""
        start, end = self.placeholder_span(ids, pos)
        run, features = self.expand(video_hash, data, offset=0, pruning_rate=pruning_rate)
        return start, end, run, features
