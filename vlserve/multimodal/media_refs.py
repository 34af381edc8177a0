"""Media items that are not plain media: an item the client named (`uuid`, with or without its media) and
precomputed image embeddings (`image_embeds` content parts), as the processor receives them.

- `NamedItem`: the name keys the processor cache, the encoder cache and prefix caching (`hashing.hash_named_item`,
  with the processor kwargs); without media, only an item cached under that name (and those kwargs) can serve it.
- `ImageEmbeds`: the embeddings one image would get from the vision tower (`[n, H]`) plus, for the M-RoPE models
  (Qwen2-VL, Qwen2.5-VL), the item's `image_grid_thw`; the tower does not run for it.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

import torch

from vlserve.multimodal.hashing import hash_mm_item
from vlserve.shorten import shorten

MAX_UUID_CHARS = 256
MAX_EMBEDS_BYTES = 64 << 20  # one image_embeds part, decoded
# Model types whose image items are placeholder runs of tower embeddings positioned by image_grid_thw.
EMBEDS_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True)
class NamedItem:
    """A media item with a client-given name; `media` None: reuse what is cached under the name."""

    uuid: str
    media: Any = None

    def require_media(self, modality: str) -> Any:
        """The media; ValueError when the request sent only the name and nothing is cached under it."""
        if self.media is None:
            raise ValueError(
                f"{modality} uuid {shorten(self.uuid)} names no cached item (or one processed with other "
                f"mm_processor_kwargs / media_io_kwargs); send the {modality} with it"
            )
        return self.media


def check_uuid(value: Any) -> str:
    """A content part's `uuid`: a non-empty string of at most MAX_UUID_CHARS characters (ValueError otherwise)."""
    if not isinstance(value, str) or not value or len(value) > MAX_UUID_CHARS:
        raise ValueError(f"a content part's uuid must be a non-empty string of <= {MAX_UUID_CHARS} characters")
    return value


@dataclass(frozen=True, eq=False)
class ImageEmbeds:
    """Precomputed embeddings of one image: `embeds` [n, H]; `grid_thw` int64 [1, 3] or None."""

    embeds: torch.Tensor
    grid_thw: torch.Tensor | None = None

    @property
    def mm_hash(self) -> str:
        items = [self.embeds] if self.grid_thw is None else [self.embeds, self.grid_thw]
        return hash_mm_item("image_embeds", items)

    def data(self) -> dict:
        """The item's processed data as the runner takes it (no pixels: the tower is skipped)."""
        return {"image_embeds": self.embeds, "image_grid_thw": self.grid_thw}

    def check(self, hf_config: Any) -> None:
        """ValueError unless the embeddings fit the model: a Qwen2-VL-family checkpoint, width == the text hidden
        size, and n == t * h * w / spatial_merge_size**2 of the item's grid."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in EMBEDS_MODEL_TYPES:
            raise ValueError(
                f"image_embeds inputs are supported for {', '.join(EMBEDS_MODEL_TYPES)} checkpoints; "
                f"this one is {shorten(model_type)}"
            )
        hidden = int(hf_config.get_text_config().hidden_size)
        n, width = self.embeds.shape
        if width != hidden:
            raise ValueError(f"image_embeds has shape [{n}, {width}]; this model takes [n, {hidden}] (its hidden size)")
        if self.grid_thw is None:
            raise ValueError(
                "image_embeds for this model needs image_grid_thw: send "
                '{"image_embeds": <base64 tensor>, "image_grid_thw": [[t, h, w]]}'
            )
        merge = int(getattr(hf_config.vision_config, "spatial_merge_size", 2))
        t, h, w = (int(x) for x in self.grid_thw[0])
        if h % merge or w % merge or t * h * w // merge**2 != n:
            raise ValueError(
                f"image_grid_thw [{t}, {h}, {w}] gives {t * h * w // merge**2} embeddings (h and w multiples of "
                f"{merge}), but image_embeds has {n} rows"
            )


def _decode_tensor(value: Any, name: str, max_bytes: int) -> torch.Tensor:
    """A base64 `torch.save`d tensor (or, for grids, a nested list of ints) -> the tensor."""
    if isinstance(value, list):
        try:
            return torch.tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"{name} must be a base64 torch.save'd tensor or a list of integers") from None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a base64 string of a torch.save'd tensor")
    if len(value) > max_bytes * 4 // 3 + 4:
        raise ValueError(f"{name} is larger than the {max_bytes} byte cap")
    try:
        raw = base64.b64decode(value, validate=True)
        tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{name} is not valid base64") from None
    except Exception as e:  # noqa: BLE001 -- untrusted bytes: any unpickling failure is the client's
        raise ValueError(f"{name} is not a torch.save'd tensor ({type(e).__name__})") from None
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must hold one tensor, got {type(tensor).__name__}")
    return tensor


def decode_image_embeds(value: Any, max_bytes: int = MAX_EMBEDS_BYTES) -> ImageEmbeds:
    """An `image_embeds` content part's value: a base64 tensor [n, H] (or [1, n, H]), or a dict
    {"image_embeds": that, "image_grid_thw": base64 tensor or list [[t, h, w]]} -> ImageEmbeds (ValueError
    naming what is wrong)."""
    grid = None
    if isinstance(value, dict):
        unknown = set(value) - {"image_embeds", "image_grid_thw"}
        if unknown:
            raise ValueError(
                f"image_embeds: unknown key(s) {shorten(sorted(unknown))}; use image_embeds, image_grid_thw"
            )
        if value.get("image_grid_thw") is not None:
            grid = _decode_tensor(value["image_grid_thw"], "image_grid_thw", 4096)
        value = value.get("image_embeds")
    embeds = _decode_tensor(value, "image_embeds", max_bytes)
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.dim() != 2 or embeds.shape[0] == 0 or not embeds.is_floating_point():
        raise ValueError(
            f"image_embeds must be a float tensor [n, H] with n >= 1, got {embeds.dtype} {list(embeds.shape)}"
        )
    if not bool(torch.isfinite(embeds).all()):
        raise ValueError("image_embeds holds NaN or infinite values")
    if grid is not None:
        if grid.is_floating_point() or grid.numel() != 3 or bool((grid <= 0).any()):
            raise ValueError(f"image_grid_thw must be 3 positive integers [[t, h, w]], got {shorten(grid.tolist())}")
        grid = grid.reshape(1, 3).to(torch.int64)
    return ImageEmbeds(embeds.contiguous(), grid)
