"""PerceptionLM's per-item processing: the checkpoint's own PerceptionLMImageProcessor cuts an image into tiles
(a thumbnail plus up to `max_num_tiles` crops for "thumb+tile", one tile otherwise) and the placeholder count is
what PerceptionLMProcessor computes from those pixels: (S // patch_size // pooling_ratio)**2 per tile.

MultiModalProcessor (processor.py) hands image items here when the checkpoint's HF processor is a
PerceptionLMProcessor. Images only: videos are not served for this family yet.
"""

from __future__ import annotations

from typing import Any

# mm_processor_kwargs that PerceptionLMImageProcessor reads for tiling.
TILING_KEYS = ("vision_input_type", "max_num_tiles")


class PerceptionLMItems:
    """Runs the HF image processor on one image and counts its embeddings (as the HF processor does)."""

    modalities = ("image",)

    def __init__(self, hf_processor: Any) -> None:
        self.image_processor = hf_processor.image_processor
        self.patch_size = int(hf_processor.patch_size)
        self.pooling_ratio = int(hf_processor.pooling_ratio)
        self.tile_size = int(self.image_processor.tile_size)

    def _check_kwargs(self, kwargs: dict) -> None:
        """The vision tower was built for one tile size: another would fail inside the engine, so refuse it here."""
        tile = kwargs.get("tile_size")
        if tile is not None and tile != self.tile_size:
            raise ValueError(
                f"mm_processor_kwargs.tile_size must equal the checkpoint's tile size "
                f"{self.tile_size} (its vision tower takes only that size), got {str(tile)[:40]}"
            )
        max_tiles = kwargs.get("max_num_tiles")
        if max_tiles is not None and (
            isinstance(max_tiles, bool) or not isinstance(max_tiles, int) or not 1 <= max_tiles <= 64
        ):
            raise ValueError(
                f"mm_processor_kwargs.max_num_tiles must be an integer in [1, 64], got {str(max_tiles)[:40]}"
            )

    def run_image(self, image: Any, kwargs: dict) -> dict:
        """One loaded image -> {"pixel_values": float [tiles, C, S, S]} (tiles in the HF processor's order)."""
        self._check_kwargs(kwargs)
        out = self.image_processor(images=[image], return_tensors="pt", **kwargs)
        return {"pixel_values": out["pixel_values"][0]}

    def num_embeds(self, modality: str, data: dict) -> int:
        """Placeholder tokens of one processed item, by PerceptionLMProcessor's rule."""
        tiles, _, height, width = data["pixel_values"].shape
        per_side = self.patch_size * self.pooling_ratio
        return (height // per_side) * (width // per_side) * tiles

    def max_image_embeds(self, kwargs: dict | None = None) -> int:
        """Upper bound on one image's embeddings: every tile plus the thumbnail (thumb+tile), else one tile."""
        kwargs = kwargs or {}
        mode = kwargs.get("vision_input_type") or self.image_processor.vision_input_type
        max_tiles = int(kwargs.get("max_num_tiles") or self.image_processor.max_num_tiles)
        tiles = max_tiles + 1 if mode == "thumb+tile" else 1
        return (self.tile_size // (self.patch_size * self.pooling_ratio)) ** 2 * tiles


def family_items(hf_processor: Any) -> PerceptionLMItems | None:
    """The per-item processor for a PerceptionLMProcessor, else None."""
    if type(hf_processor).__name__ == "PerceptionLMProcessor":
        return PerceptionLMItems(hf_processor)
    return None
