"""Per-image processing rules of InternVL (HF `InternVLProcessor` + `GotOcr2ImageProcessor`), for
MultiModalProcessor: the image processor tiles each image (`crop_to_patches`: a grid of S x S tiles chosen by aspect
ratio, plus a thumbnail when there is more than one tile) and the prompt's `<IMG_CONTEXT>` becomes
`<img>` + `<IMG_CONTEXT>` * (image_seq_length * tiles) + `</img>`, as InternVLProcessor expands it. The
embeddings cover the context tokens only; `<img>` / `</img>` are ordinary prompt tokens around them.
"""
from __future__ import annotations

from typing import Any

# What InternVLProcessor passes to its image processor unless told otherwise.
DEFAULT_IMAGE_KWARGS = {"crop_to_patches": True}


def is_internvl_processor(hf_processor: Any) -> bool:
    """Whether the HF processor is InternVLProcessor (matched by class name)."""
    return type(hf_processor).__name__ == "InternVLProcessor"


class InternVLImageItems:
    """InternVL items: data = {"pixel_values": float [tiles, C, S, S]}."""

    modalities = ("image",)

    def __init__(self, hf_processor: Any) -> None:
        self.image_processor = hf_processor.image_processor
        self.seq_length = int(hf_processor.image_seq_length)
        self.start_id = int(hf_processor.start_image_token_id)
        self.end_id = int(hf_processor.end_image_token_id)

    def run_image(self, image: Any, kwargs: dict) -> dict:
        """One loaded image -> its tiles from the HF image processor."""
        out = self.image_processor(images=[image], return_tensors="pt", **{**DEFAULT_IMAGE_KWARGS, **kwargs})
        return {"pixel_values": out["pixel_values"]}  # [tiles, C, S, S]

    def num_embeds(self, modality: str, data: dict) -> int:
        """Context tokens (= embeddings) of one processed image."""
        return int(data["pixel_values"].shape[0]) * self.seq_length

    def placeholder_run(self, placeholder_id: int, num: int, data: dict) -> tuple[list[int], int]:
        """The tokens one image's placeholder expands to, and where its embeddings start in them."""
        return [self.start_id] + [placeholder_id] * num + [self.end_id], 1

    def max_image_embeds(self, mm_processor_kwargs: dict | None = None) -> int:
        """At most max_patches tiles plus the thumbnail."""
        kw = {**DEFAULT_IMAGE_KWARGS, **(mm_processor_kwargs or {})}
        max_tiles = int(kw.get("max_patches", self.image_processor.max_patches))
        tiles = max_tiles + 1 if kw.get("crop_to_patches") and max_tiles > 1 else 1
        return tiles * self.seq_length
