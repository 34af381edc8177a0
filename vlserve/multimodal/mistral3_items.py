"""Mistral 3 / Pixtral per-image processing for MultiModalProcessor: the checkpoint's PixtralImageProcessor resizes
an image (aspect ratio kept, longest edge bounded) to a multiple of patch_size * spatial_merge_size, and the
placeholder run is what HF's PixtralProcessor writes: per row of merged patches, one `[IMG]` per column then
`[IMG_BREAK]`, the last `[IMG_BREAK]` being `[IMG_END]`.

Representation: one item = one contiguous run of `rows * (cols + 1)` embeddings. The model's encoder output for an
item has rows for the break / end positions too, filled with those tokens' own input embeddings (the ids travel in
the item's data as `special_token_ids`), so the runner can write the whole run over the placeholders whichever
ids the prompt holds there. `placeholder_ids` gives HF's exact ids for the run.

Item data: {"pixel_values": float [P, C*p*p] (patches row-major, see `patch_rows`), "image_sizes":
int64 [1, 2] (resized height, width in pixels), "special_token_ids": int64 [1, 2] ([IMG_BREAK], [IMG_END] ids)}; rows
of several items concatenate along dim 0, which is how the runner batches them.
"""

from __future__ import annotations

from typing import Any

import torch


def merged_grid(image_size, unit: int) -> tuple[int, int]:
    """(rows, cols) of LLM image tokens of an image resized to `image_size` (height, width) pixels."""
    height, width = (int(v) for v in image_size)
    return height // unit, width // unit


def run_token_ids(rows: int, cols: int, image_id: int, break_id: int, end_id: int) -> list[int]:
    """The placeholder run of a rows x cols token grid as HF's PixtralProcessor writes it."""
    ids = ([image_id] * cols + [break_id]) * rows
    ids[-1] = end_id
    return ids


def patch_rows(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """One image `[C, H, W]` (H, W multiples of `patch`) -> its patches row-major `[(H/p) * (W/p), C*p*p]`, each
    flattened in the conv weight's (C, p, p) order."""
    c, height, width = pixels.shape
    gh, gw = height // patch, width // patch
    cut = pixels[:, : gh * patch, : gw * patch].reshape(c, gh, patch, gw, patch)
    return cut.permute(1, 3, 0, 2, 4).reshape(gh * gw, c * patch * patch)


class PixtralImageItems:
    """Runs the HF image processor on one image and counts / spells its placeholder run (as PixtralProcessor)."""

    modalities = ("image",)

    def __init__(self, hf_processor: Any) -> None:
        self.image_processor = hf_processor.image_processor
        self.patch_size = int(hf_processor.patch_size)
        self.unit = self.patch_size * int(hf_processor.spatial_merge_size)  # pixels per LLM token side
        self.image_id = int(hf_processor.image_token_id)
        self.break_id = int(hf_processor.image_break_token_id)
        self.end_id = int(hf_processor.image_end_token_id)

    def run_image(self, image: Any, kwargs: dict) -> dict:
        """One loaded image -> its item data (see the module docstring)."""
        out = self.image_processor(images=[image], return_tensors="pt", **dict(kwargs, patch_size=self.unit))
        height, width = (int(v) for v in out["image_sizes"][0])
        pixels = torch.as_tensor(out["pixel_values"])[0, :, :height, :width]  # [C, H, W]
        return {
            "pixel_values": patch_rows(pixels, self.patch_size),  # [P, C*p*p]
            "image_sizes": torch.tensor([[height, width]], dtype=torch.long),
            "special_token_ids": torch.tensor([[self.break_id, self.end_id]], dtype=torch.long),
        }

    def num_embeds(self, modality: str, data: dict) -> int:
        """Placeholder tokens of one processed image: rows * (cols + 1)."""
        rows, cols = merged_grid(data["image_sizes"][0].tolist(), self.unit)
        return rows * (cols + 1)

    def placeholder_ids(self, data: dict) -> list[int]:
        """The exact token ids of one image's placeholder run, as HF's PixtralProcessor expands it."""
        return run_token_ids(
            *merged_grid(data["image_sizes"][0].tolist(), self.unit), self.image_id, self.break_id, self.end_id
        )

    def placeholder_run(self, placeholder_id: int, num: int, data: dict) -> tuple[list[int], int]:
        """(the run's token ids, 0): every token of it, breaks and end included, is a row of the embeddings."""
        return self.placeholder_ids(data), 0

    def max_image_embeds(self, kwargs: dict | None = None) -> int:
        """Upper bound: a square image at the longest edge, n x n tokens plus n breaks."""
        size = (kwargs or {}).get("size") or self.image_processor.size
        size = dict(size)
        edge = int(size.get("longest_edge") or max(size.get("height", 0), size.get("width", 0)))
        n = -(-edge // self.unit)
        return n * (n + 1)
