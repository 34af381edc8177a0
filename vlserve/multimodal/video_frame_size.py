"""The size each decoded video frame is kept at: no larger than what the checkpoint's video processor keeps of it.

A Qwen2-VL / Qwen2.5-VL video processor resizes every frame to `smart_resize(height, width)` (sides multiples of
patch_size x merge_size, pixels within size["shortest_edge"] .. size["longest_edge"]). A frame larger than that
target is decoded straight to the smallest size the processor takes to the same target: the target itself when
smart_resize keeps it, else (when the target falls below min_pixels, as with min_pixels == max_pixels) the frame
scaled down, aspect kept, by the least that smart_resize still maps to the target; checked, never assumed. So the
grid and the prompt's token count are those of the full-size frame, only the resampling differs (swscale's
bicubic first). Frames at the target size or smaller are kept as decoded, so their tokens are unchanged.
Other processors (fixed tiles, Qwen3-VL's per-video budget) get the server's cap: frames of more than
`max_frame_pixels` pixels are scaled down to fit it, aspect kept; smaller frames are kept as decoded.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from vlserve.multimodal.video_decode import FrameSize, fit_within_pixels

# 1280x720: every processor served here but Qwen3-VL (whose budget is per video) resizes a video frame to at most
# ~0.8 MP (InternVL / PerceptionLM 448 px tiles, LLaVA 336-384 px, Qwen2-VL 768 x 28 x 28 by default), so a 720p frame
# keeps all they use while 256 sampled frames stay under 0.7 GB; Qwen2-VL-family frames are cut to their exact size.
DEFAULT_MAX_VIDEO_FRAME_PIXELS = 1280 * 720
_GRID_KWARGS = {"size"}  # video processor kwargs the Qwen2-VL rule knows (min/max_pixels arrive as `size`)


def qwen2_vl_frame_size(video_processor: Any, hf_kwargs: dict) -> FrameSize | None:
    """The FrameSize that decodes a frame larger than a Qwen2-VL video processor needs at a size the processor
    resizes to the same target (None: not such a processor, or kwargs / settings the rule does not account for)."""
    from transformers import Qwen2VLVideoProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize

    if type(video_processor) is not Qwen2VLVideoProcessor or set(hf_kwargs) - _GRID_KWARGS:
        return None
    if getattr(video_processor, "cap_pixels_per_frame", None):  # its per-frame bound depends on the frame count
        return None
    size = hf_kwargs.get("size") or video_processor.size
    factor = int(video_processor.patch_size) * int(video_processor.merge_size)
    bounds = {"min_pixels": int(size["shortest_edge"]), "max_pixels": int(size["longest_edge"])}

    @functools.lru_cache(maxsize=8)  # one size per video, looked up once per frame
    def frame_size(height: int, width: int) -> tuple[int, int]:
        try:
            target = smart_resize(height, width, factor, **bounds)
        except ValueError:  # an aspect ratio the processor refuses: it reports that itself
            return height, width
        pixels = height * width
        candidates = [target]
        area = max(target[0] * target[1], bounds["max_pixels"])
        while area < pixels:  # the frame scaled down, aspect kept, in steps of 1.25x in area
            scale = math.sqrt(area / pixels)
            candidates.append((max(1, round(height * scale)), max(1, round(width * scale))))
            area *= 1.25
        for candidate in candidates:
            if candidate[0] * candidate[1] < pixels and _maps_to(smart_resize, candidate, factor, bounds, target):
                return candidate
        return height, width

    return frame_size


def _maps_to(smart_resize: Any, size: tuple[int, int], factor: int, bounds: dict, target: tuple[int, int]) -> bool:
    try:
        return smart_resize(*size, factor, **bounds) == target
    except ValueError:
        return False


def video_frame_size(video_processor: Any, hf_kwargs: dict, max_frame_pixels: int | None) -> FrameSize | None:
    """The FrameSize for a video processor: the Qwen2-VL rule where it applies, else the server's pixel cap."""
    exact = qwen2_vl_frame_size(video_processor, hf_kwargs)
    if exact is not None:
        return exact
    return fit_within_pixels(max_frame_pixels) if max_frame_pixels else None
