"""Per-image processing rules of the LLaVA family, for MultiModalProcessor: what to keep of one image's HF image
processor output and how many placeholder tokens (= embeddings) it expands to, as the HF LlavaProcessor /
LlavaNextProcessor count them.

LLaVA-1.5: every image becomes one [C, S, S] tensor: (S / patch)**2 + num_additional_image_tokens embeddings,
minus one under the "default" select strategy (the class token is dropped).
LLaVA-NeXT: the base image plus anyres tiles; the count adds the unpadded feature grid and one newline per row
(vlserve.multimodal.anyres), so it depends on the image's size and aspect ratio.
"""

from __future__ import annotations

from typing import Any

import torch

from vlserve.multimodal.anyres import anyres_layout, max_grid_features
from vlserve.multimodal.internvl_items import InternVLImageItems
from vlserve.multimodal.mistral3_items import PixtralImageItems


def _processed_side(image_processor: Any) -> tuple[int, int]:
    """(height, width) of the tensors the image processor emits: the crop when it center-crops, else its size."""
    size = image_processor.crop_size if getattr(image_processor, "do_center_crop", False) else image_processor.size
    size = dict(size)
    if size.get("height") is not None:
        return int(size["height"]), int(size["width"])
    return int(size["shortest_edge"]), int(size["shortest_edge"])


class LlavaImageItems:
    """LLaVA-1.5 items: data = {"pixel_values": float [1, C, S, S]}."""

    def __init__(self, hf_processor: Any) -> None:
        self.image_processor = hf_processor.image_processor
        self.patch_size = int(hf_processor.patch_size)
        self.num_additional = int(getattr(hf_processor, "num_additional_image_tokens", 0) or 0)
        self.drop_cls = getattr(hf_processor, "vision_feature_select_strategy", "default") == "default"

    modalities = ("image",)

    def run_image(self, image: Any, kwargs: dict) -> dict:
        """One loaded image -> what to keep of the HF image processor's output for it."""
        return self.data_from(self.image_processor(images=[image], return_tensors="pt", **kwargs))

    def data_from(self, out: Any) -> dict:
        """What to keep of the image processor's output for one image."""
        return {"pixel_values": out["pixel_values"]}

    def _count(self, height: int, width: int) -> int:
        return (height // self.patch_size) * (width // self.patch_size) + self.num_additional - int(self.drop_cls)

    def num_embeds(self, modality: str, data: dict) -> int:
        """Placeholder tokens of one processed image."""
        height, width = data["pixel_values"].shape[-2:]
        return self._count(int(height), int(width))

    def max_image_embeds(self, mm_processor_kwargs: dict | None = None) -> int:
        """Every image gives the same count."""
        return self._count(*_processed_side(self.image_processor))


class LlavaNextImageItems(LlavaImageItems):
    """LLaVA-NeXT items: data = {"pixel_values": float [1 + tiles, C, S, S], "image_sizes": int64 [1, 2]}."""

    def __init__(self, hf_processor: Any) -> None:
        super().__init__(hf_processor)
        self.pinpoints = [tuple(int(v) for v in p) for p in self.image_processor.image_grid_pinpoints]

    def data_from(self, out: Any) -> dict:
        pixels = out["pixel_values"]
        pixels = pixels[0] if pixels.dim() == 5 else pixels  # [1 + tiles, C, S, S]
        sizes = torch.as_tensor(out["image_sizes"], dtype=torch.long).reshape(1, 2)
        return {"pixel_values": pixels, "image_sizes": sizes}

    def num_embeds(self, modality: str, data: dict) -> int:
        tile = int(data["pixel_values"].shape[-2])
        height, width = data["image_sizes"][0].tolist()
        layout = anyres_layout(int(height), int(width), self.pinpoints, tile, tile // self.patch_size)
        return self._count(tile, tile) + layout.num_grid_features()

    def max_image_embeds(self, mm_processor_kwargs: dict | None = None) -> int:
        """A true upper bound: the base image plus the largest pinpoint grid with nothing unpadded."""
        tile, _ = _processed_side(self.image_processor)
        return self._count(tile, tile) + max_grid_features(self.pinpoints, tile, tile // self.patch_size)


_FAMILIES = {
    "LlavaProcessor": LlavaImageItems,
    "LlavaNextProcessor": LlavaNextImageItems,
    "PixtralProcessor": PixtralImageItems,  # Mistral 3: vlserve.multimodal.mistral3_items
    "InternVLProcessor": InternVLImageItems,
}  # InternVL: vlserve.multimodal.internvl_items


def image_items_for(hf_processor: Any) -> LlavaImageItems | None:
    """The LLaVA-family rules for this HF processor, or None for processors MultiModalProcessor handles itself
    (Qwen2-VL / Qwen2.5-VL, whose image outputs carry their grids)."""
    cls = _FAMILIES.get(type(hf_processor).__name__)
    return cls(hf_processor) if cls is not None else None
