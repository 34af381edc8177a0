"""LLaVA-NeXT (`LlavaNextForConditionalGeneration`): LLaVA with "anyres" images (vlserve.multimodal.anyres).

Each image arrives as `1 + tiles` tower inputs (the downscaled base image first); its features are the base
image's F features, then the tiles' features laid out as one feature grid, unpadded to the image's aspect ratio,
with the learned `image_newline` embedding closing every row. So the count per image depends on its size.

embed_multimodal data = {"pixel_values": [sum of tiles, C, S, S], "image_sizes": [N, 2] (original height,
width)} for N images in item order -> `[sum of counts, H]`.
"""

from __future__ import annotations

import torch
from torch import nn

from vlserve.models.llama import copy_weight
from vlserve.models.llava import LlavaForConditionalGeneration
from vlserve.models.registry import register_model
from vlserve.multimodal.anyres import anyres_layout


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA + anyres tiling, unpadding and `image_newline` rows (loaded as `image_newline` / `model.image_newline`)."""

    capabilities = LlavaForConditionalGeneration.capabilities

    def __init__(self, config) -> None:
        super().__init__(config)
        self.image_newline = nn.Parameter(torch.zeros(self.text_config.hidden_size))
        self.pinpoints = [tuple(int(v) for v in p) for p in config.image_grid_pinpoints]
        tower = self.vision_tower.cfg
        self.tile_size = tower.image_size
        self.patches_per_side = tower.image_size // tower.patch_size

    def layouts(self, image_sizes) -> list:
        """The anyres layout of each (height, width) row of `image_sizes`."""
        sizes = torch.as_tensor(image_sizes).reshape(-1, 2).tolist()
        return [anyres_layout(int(h), int(w), self.pinpoints, self.tile_size, self.patches_per_side) for h, w in sizes]

    @torch.no_grad()
    def embed_multimodal(self, modality: str, data: dict) -> torch.Tensor:
        """All tiles of the step's images in one tower call, then per image: base features, then the unpadded
        grid with a newline per row -> `[sum of counts, H]`."""
        if modality != "image":
            raise ValueError(f"{type(self).__name__} supports image inputs, not {modality!r}")
        layouts = self.layouts(data["image_sizes"])
        pixels = data["pixel_values"]  # [sum tiles, C, S, S]
        if pixels.shape[0] != sum(lay.num_tiles for lay in layouts):
            raise ValueError(
                f"{pixels.shape[0]} tiles given for images needing {[lay.num_tiles for lay in layouts]} tiles"
            )
        feats = self.tile_features(pixels)  # [sum tiles, F, H]
        side = self.patches_per_side
        if feats.shape[1] != side * side:
            raise ValueError(
                f"anyres packing needs {side * side} features per tile, the tower gave "
                f"{feats.shape[1]} (vision_feature_select_strategy 'full' with a class token?)"
            )
        hidden = feats.shape[-1]
        newline = self.image_newline.to(feats.dtype)
        out = []
        for lay, per_image in zip(layouts, feats.split([lay.num_tiles for lay in layouts])):
            tiles_h, tiles_w = lay.grid_rows // side, lay.grid_cols // side
            grid = per_image[1:].view(tiles_h, tiles_w, side, side, hidden)  # [th, tw, side, side, H]
            grid = grid.permute(0, 2, 1, 3, 4).reshape(lay.grid_rows, lay.grid_cols, hidden)  # [rows, cols, H]
            grid = grid[lay.top : lay.bottom, lay.left : lay.right]  # [kept rows, kept cols, H]
            rows = torch.cat([grid, newline.view(1, 1, -1).expand(grid.shape[0], 1, hidden)], dim=1)
            out += [per_image[0], rows.reshape(-1, hidden)]  # base [F, H], grid [kept rows * (cols + 1), H]
        return torch.cat(out).to(self.embed_dtype)

    def _load_extra(self, part: str, rel: str, tensor: torch.Tensor) -> str | None:
        if part == "image_newline" and rel == "":
            copy_weight(self.image_newline, tensor, "image_newline")
            return "image_newline"
        return None

    def expected_weight_names(self) -> set[str]:
        held = {"image_newline"} if self.image_newline is not None else set()  # None off the first pipeline stage
        return super().expected_weight_names() | held


register_model("LlavaNextForConditionalGeneration", "vlserve.models.llava_next:LlavaNextForConditionalGeneration")
