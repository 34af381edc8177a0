"""Requests of a dual-tower embedder (CLIP, SigLIP): each is one text or one image, never both.

A text is tokenized as the family's processor does (CLIP: `CLIPProcessor`'s tokenizer call, no padding; SigLIP:
padded to `max_length`, as HF's docs use `SiglipProcessor`). An image becomes a one-token prompt, the placeholder,
whose one "embedding" is the image tower's pooled and projected output: the runner's encoder path computes it and
the encoder cache holds it by mm_hash, so the same image embedded twice runs the tower once. Loading, hashing and
the processed-item cache are `MultiModalProcessor`'s; the family's image processor runs each image alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from vlserve.multimodal.hashing import hash_pil_pixels
from vlserve.multimodal.inputs import MultiModalFeature
from vlserve.multimodal.media import load_image
from vlserve.multimodal.media_refs import ImageEmbeds, NamedItem
from vlserve.multimodal.processor import MultiModalProcessor, load_hf_processor


class DualTowerImageItems:
    """The per-image rule `MultiModalProcessor` takes from a family: one `[1, 3, S, S]` pixel tensor per image,
    one embedding (one placeholder token) each."""

    def __init__(self, hf_processor: Any) -> None:
        self.image_processor = hf_processor.image_processor

    def run_image(self, image: Any, kwargs: dict) -> dict:
        out = self.image_processor(images=[image], return_tensors="pt", **kwargs)
        return {"pixel_values": out["pixel_values"]}  # [1, 3, S, S]

    def num_embeds(self, modality: str, data: dict) -> int:
        return 1

    def max_image_embeds(self, mm_processor_kwargs: dict | None = None) -> int:
        return 1


class DualTowerProcessor(MultiModalProcessor):
    """Turns one request of a dual-tower embedder into (prompt ids, features): a text's ids (padded to
    `text_padding_length` when the family pads; checked by `check_text_ids`), or one image's placeholder prompt
    and its feature. ValueError for text and image together, several images, or other media."""

    def __init__(
        self,
        hf_processor: Any,
        text_padding_length: int | None,
        check_text_ids: Callable[[list[int]], None],
        **kwargs: Any,
    ):
        tokenizer = hf_processor.tokenizer
        placeholder = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        super().__init__(hf_processor, image_token_id=placeholder or 0, **kwargs)
        self.family = DualTowerImageItems(hf_processor)
        self.text_padding_length = text_padding_length
        self.check_text_ids = check_text_ids

    @classmethod
    def from_pretrained(cls, model_dir: str, use_fast: bool = True, **kwargs: Any) -> DualTowerProcessor:
        """The checkpoint's processor (CLIPProcessor / SiglipProcessor) from a local directory, wrapped."""
        return cls(load_hf_processor(model_dir, use_fast), **kwargs)

    def process_image(self, image: Any, image_kwargs: dict | None = None) -> tuple[str, dict]:
        """`MultiModalProcessor.process_image`, with a loaded image's pixels taken out of PIL once (each array
        conversion of a PIL image copies them through its raw encoder): that `[H, W, 3]` array is hashed (the PIL
        image's mm_hash) and given to the image processor (the PIL image's pixel_values)."""
        if isinstance(image, (ImageEmbeds, NamedItem)):
            return super().process_image(image, image_kwargs)
        image_kwargs = image_kwargs or {}
        img = load_image(image, max_pixels=self.max_image_pixels)  # RGB
        pixels = np.array(img)  # [H, W, 3] uint8 (writable: torch.from_numpy warns on a read-only one)
        mm_hash = hash_pil_pixels(img.mode, pixels, image_kwargs)
        return mm_hash, self._get_or_compute(mm_hash, lambda: self._run_image(pixels, image_kwargs))

    def tokenize(self, text: str) -> list[int]:
        """A text's ids as the family's processor makes them."""
        if self.text_padding_length is None:
            return self.tokenizer(text)["input_ids"]
        return self.tokenizer(text, padding="max_length", max_length=self.text_padding_length)["input_ids"]

    def process_request(
        self,
        text: str | None,
        token_ids: list[int] | None,
        mm_data: dict[str, list],
        mm_processor_kwargs: dict | None = None,
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """One request: a text (`text`, or its `token_ids`) or one image (`mm_data["image"]`, with no text or an
        empty one) -> (prompt ids, features)."""
        media = {m: items for m, items in mm_data.items() if items}
        if media:
            others = sorted(set(media) - {"image"})
            if others:
                raise ValueError(f"a dual-tower embedder takes texts and images, not {', '.join(others)}")
            if len(media["image"]) != 1:
                raise ValueError(f"a dual-tower embedder embeds one image per request, got {len(media['image'])}")
            if text or token_ids:
                raise ValueError(
                    "a dual-tower embedder embeds a text or an image, not both in one request: give the image with "
                    'an empty prompt ("") and the text as a request of its own'
                )
            return self.process([self.image_token_id], images=media["image"], mm_processor_kwargs=mm_processor_kwargs)
        if token_ids is None:
            token_ids = self.tokenize(text or "")
        elif not isinstance(token_ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of integers, got {type(token_ids).__name__}")
        self.check_text_ids(list(token_ids))
        return list(token_ids), []

    def check_prompt(self, token_ids: list[int], features: list[MultiModalFeature]) -> None:
        """ValueError unless a processed prompt is what this family embeds: a text's checked ids, or one image's
        one-token placeholder prompt (prompts made elsewhere, e.g. tokenized without special tokens, meet it too)."""
        if not features:
            self.check_text_ids(list(token_ids))
            return
        item = features[0]
        if len(features) != 1 or item.modality != "image" or (item.offset, item.length, len(token_ids)) != (0, 1, 1):
            raise ValueError("a dual-tower embedder's media prompt is one image's placeholder token, nothing else")


def single_part(messages: list[dict]) -> dict:
    """The one content part of a parsed conversation (`parse_chat_messages`' messages): a dual-tower request is one
    text or one image; ValueError otherwise."""
    parts = []
    for msg in messages:
        content = msg.get("content")
        parts += [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    if len(parts) != 1:
        raise ValueError(
            f"a dual-tower embedder takes one text or one image per conversation, got {len(parts)} content parts"
        )
    return parts[0]
