"""LLaVA-NeXT "anyres" geometry, shared by the processor (placeholder counts) and the model (feature packing).

An image of original size (h, w) is resized into the best of the checkpoint's `image_grid_pinpoints` resolutions,
cut into tiles of the tower's input size, and encoded together with a downscaled base image. The tile features
form a (rows x cols) feature grid from which the rows / columns that only cover padding are removed ("unpadding"),
and one `image_newline` embedding ends every remaining row.
"""

from __future__ import annotations

from dataclasses import dataclass


def select_best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """The (height, width) among `pinpoints` that keeps the most of the image's resolution when it is scaled to
    fit, ties broken by the least wasted area (the first such one wins, like the HF processors)."""
    best, best_effective, best_waste = None, -1, float("inf")
    for cand_h, cand_w in pinpoints:
        scale = min(cand_w / width, cand_h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        waste = cand_h * cand_w - effective
        if effective > best_effective or (effective == best_effective and waste < best_waste):
            best, best_effective, best_waste = (int(cand_h), int(cand_w)), effective, waste
    if best is None:
        raise ValueError("image_grid_pinpoints is empty")
    return best


@dataclass(frozen=True)
class AnyresLayout:
    """Where one image's features come from: `num_tiles` tower inputs (the base image first), a
    `grid_rows x grid_cols` feature grid over the tiles, of which rows [top, bottom) and columns [left, right)
    survive unpadding."""

    num_tiles: int
    grid_rows: int
    grid_cols: int
    top: int
    bottom: int
    left: int
    right: int

    @property
    def kept_rows(self) -> int:
        return self.bottom - self.top

    @property
    def kept_cols(self) -> int:
        return self.right - self.left

    def num_grid_features(self) -> int:
        """Unpadded grid features plus one newline per kept row."""
        return self.kept_rows * (self.kept_cols + 1)


def anyres_layout(height: int, width: int, pinpoints, tile_size: int, patches_per_side: int) -> AnyresLayout:
    """The layout of an image of original size (height, width) for tiles of `tile_size` pixels, each giving a
    `patches_per_side`**2 feature grid."""
    best_h, best_w = select_best_resolution(height, width, pinpoints)
    tiles_h, tiles_w = best_h // tile_size, best_w // tile_size
    rows, cols = tiles_h * patches_per_side, tiles_w * patches_per_side
    top, bottom, left, right = 0, rows, 0, cols
    if width / height > cols / rows:  # wider than the grid: padding above and below
        kept = int(round(height * (cols / width), 7))
        pad = (rows - kept) // 2
        top, bottom = pad, rows - pad
    else:  # taller (or equal): padding left and right
        kept = int(round(width * (rows / height), 7))
        pad = (cols - kept) // 2
        left, right = pad, cols - pad
    return AnyresLayout(tiles_h * tiles_w + 1, rows, cols, top, bottom, left, right)


def max_grid_features(pinpoints, tile_size: int, patches_per_side: int) -> int:
    """An upper bound on `num_grid_features` over all image sizes: the largest pinpoint grid, unpadded nowhere."""
    bound = 0
    for cand_h, cand_w in pinpoints:
        rows = cand_h // tile_size * patches_per_side
        cols = cand_w // tile_size * patches_per_side
        bound = max(bound, rows * (cols + 1))
    return bound
