"""Per-item processing rules of InternVL (HF `InternVLProcessor` + `GotOcr2ImageProcessor` / `InternVLVideoProcessor`),
for MultiModalProcessor.

Images: the image processor tiles each image (`crop_to_patches`: a grid of S x S tiles chosen by aspect ratio, plus a
thumbnail when there is more than one tile) and the prompt's `<IMG_CONTEXT>` becomes
`<img>` + `<IMG_CONTEXT>` * (image_seq_length * tiles) + `</img>`, as InternVLProcessor expands it. The embeddings
cover the context tokens only; `<img>` / `</img>` are ordinary prompt tokens around them.

Videos: every sampled frame is resized to one S x S tile (no tiling, no thumbnail) and the prompt's `<video>` becomes
`Frame1: <img>` + `<IMG_CONTEXT>` * image_seq_length + `</img>\\nFrame2: <img>...</img>`, one line per frame. Text
sits between the frames' runs, so a video gives one "video" feature per frame (`expand_video`), each encoded like an
image tile.
"""

from __future__ import annotations

from typing import Any

from vlserve.multimodal.inputs import MultiModalFeature
from vlserve.multimodal.qwen3_vl_video import frame_hash

# What InternVLProcessor passes to its image processor unless told otherwise.
DEFAULT_IMAGE_KWARGS = {"crop_to_patches": True}
# Tiling kwargs of the image processor, which the video processor does not take.
IMAGE_ONLY_KEYS = ("crop_to_patches", "min_patches", "max_patches")


def is_internvl_processor(hf_processor: Any) -> bool:
    """Whether the HF processor is InternVLProcessor (matched by class name)."""
    return type(hf_processor).__name__ == "InternVLProcessor"


class InternVLImageItems:
    """InternVL items: image data = {"pixel_values": float [tiles, C, S, S]}, video data =
    {"pixel_values_videos": float [frames, C, S, S]} (one frame's feature: [1, C, S, S])."""

    modalities = ("image", "video")

    def __init__(self, hf_processor: Any) -> None:
        self.image_processor = hf_processor.image_processor
        self.video_processor = getattr(hf_processor, "video_processor", None)
        self.tokenizer = hf_processor.tokenizer
        self.seq_length = int(hf_processor.image_seq_length)
        self.start_id = int(hf_processor.start_image_token_id)
        self.end_id = int(hf_processor.end_image_token_id)
        self.context_id = int(hf_processor.image_token_id)
        self.video_token_id = (
            int(self.tokenizer.convert_tokens_to_ids(hf_processor.video_token))
            if self.video_processor is not None
            else None
        )
        self.special_ids = frozenset(self.tokenizer.all_special_ids)
        self._memo: dict[str, list[int]] = {}  # "\nFrame{i}: " -> its ids (a handful of entries)

    def run_image(self, image: Any, kwargs: dict) -> dict:
        """One loaded image -> its tiles from the HF image processor."""
        out = self.image_processor(images=[image], return_tensors="pt", **{**DEFAULT_IMAGE_KWARGS, **kwargs})
        return {"pixel_values": out["pixel_values"]}  # [tiles, C, S, S]

    def run_video(self, frames: Any, kwargs: dict) -> dict:
        """Sampled frames `[T, H, W, 3]` uint8 -> one S x S tile per frame from the HF video processor."""
        kwargs = {k: v for k, v in kwargs.items() if k not in IMAGE_ONLY_KEYS}
        out = self.video_processor(
            videos=[frames], return_tensors="pt", do_sample_frames=False, input_data_format="channels_last", **kwargs
        )
        return {"pixel_values_videos": out["pixel_values_videos"][0]}  # [T, C, S, S]

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

    def max_video_embeds(self, num_frames: int, mm_processor_kwargs: dict | None = None) -> int:
        """One tile per frame."""
        return num_frames * self.seq_length

    # ---- videos -------------------------------------------------------------------------------------------------
    def _text_ids(self, text: str) -> list[int]:
        ids = self._memo.get(text)
        if ids is None:
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if len(self._memo) < 1024:
                self._memo[text] = ids
        return ids

    def _joined(self, segment: list[int], text: str) -> list[int]:
        """`segment` (prompt text ids up to the placeholder) followed by `text`, tokenized together as HF does when
        the segment round-trips through decode (a prompt given as text); else the two tokenized apart."""
        if segment:
            decoded = self.tokenizer.decode(segment, clean_up_tokenization_spaces=False)
            if self.tokenizer(decoded, add_special_tokens=False)["input_ids"] == segment:
                return list(self.tokenizer(decoded + text, add_special_tokens=False)["input_ids"])
        return segment + self._text_ids(text)

    def expand_video(
        self, video_hash: str, data: dict, ids: list[int], pos: int
    ) -> tuple[int, int, list[int], list[MultiModalFeature]]:
        """The `<video>` at `ids[pos]` -> (start, end, run, features): `ids[start:end]` becomes `run`, one "video"
        feature per frame with offsets counted from the start of `run`.

        HF writes `Frame1: ` into the prompt text before tokenizing, so the text just before the placeholder (back
        to the previous special token) is tokenized again together with it."""
        frames = data["pixel_values_videos"]  # [T, C, S, S]
        start = pos
        while start > 0 and ids[start - 1] not in self.special_ids:
            start -= 1
        run = self._joined(list(ids[start:pos]), "Frame1: ")
        features: list[MultiModalFeature] = []
        for i in range(int(frames.shape[0])):
            if i:
                run.extend(self._text_ids(f"\nFrame{i + 1}: "))
            run.append(self.start_id)
            # cloned: pickling one frame's data must not carry the whole video's storage along
            frame = {"pixel_values_videos": frames[i : i + 1].clone()}  # [1, C, S, S]
            features.append(
                MultiModalFeature(
                    modality="video",
                    mm_hash=frame_hash(video_hash, i),
                    offset=len(run),
                    length=self.seq_length,
                    data=frame,
                )
            )
            run.extend([self.context_id] * self.seq_length)
            run.append(self.end_id)
        return start, pos + 1, run, features
