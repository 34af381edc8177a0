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
    # the live video session whose window holds this item (its data then crosses to an engine process once)
    session_id: str | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


# What a disaggregated consumer needs of an item the producer encoded (no media): the placeholders' span, the hash
# (prefix-cache keys) and the grid keys M-RoPE positions come from.
REMOTE_DATA_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "video_time_offset")


def feature_to_remote(f: MultiModalFeature) -> dict:
    """JSON-able description of an item without its pixel data (the producer's kv_transfer_params)."""
    data = {}
    for k in REMOTE_DATA_KEYS:
        v = f.data.get(k)
        if v is not None:
            data[k] = v.tolist() if hasattr(v, "tolist") else v
    return {"modality": f.modality, "mm_hash": f.mm_hash, "offset": f.offset, "length": f.length, "data": data}


def feature_from_remote(d: dict) -> MultiModalFeature:
    """The consumer's media-less item: `data["remote_media"]` marks it (the encoder can never run it)."""
    import torch

    data = {k: torch.tensor(v) for k, v in (d.get("data") or {}).items() if k in REMOTE_DATA_KEYS}
    data["remote_media"] = True
    return MultiModalFeature(str(d["modality"]), str(d["mm_hash"]), int(d["offset"]), int(d["length"]), data)
