"""Plain-data description of one media item inside a request (what the scheduler and caches see)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class MultiModalFeature:
    """One image/video/audio item of a prompt after the HF processor ran.

    The scheduler, KV manager and encoder cache read only modality, mm_hash, offset and length; `data` carries the
    processed inputs (tensors) through to the model runner untouched.
    """

    modality: str  # "image" | "video" | "audio"
    mm_hash: str  # content hash of the item + processor kwargs (same media => same hash)
    offset: int  # index in prompt_token_ids of the first placeholder token of this item
    length: int  # number of placeholder tokens == number of embeddings the encoder produces
    data: dict[str, Any] = field(default_factory=dict, repr=False)  # e.g. pixel_values, image_grid_thw

    @property
    def end(self) -> int:
        return self.offset + self.length
