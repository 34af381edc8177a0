"""Gemma 3 per-image processing for MultiModalProcessor (HF `Gemma3Processor` + its Gemma3 image processor).

The prompt names an image with `<start_of_image>`. HF's processor rewrites the prompt TEXT before tokenizing it:
each image becomes `\\n\\n<start_of_image>` + image_seq_length x `<image_soft_token>` + `<end_of_image>\\n\\n`, and
with pan-and-scan (`do_pan_and_scan`, a processor kwarg) `Here is the original image <run> and here are some crops
to help you see better <run> <run> ...`, one run per crop after the original. The newlines and words join the text
around them before tokenization ("user\\n" + "\\n\\n" may become one token), so `expand_prompt` tokenizes anew every
text segment an image touches: the ordinary tokens between two special tokens, decoded, with the added text, encoded
again (the tokenizer splits text at special tokens, so segments tokenize independently, as in HF). Segments no image
touches keep their ids.

Representation: one item per crop (the original image first, then the crops in the image processor's order), each
covering its image_seq_length soft tokens only; `<start_of_image>` / `<end_of_image>` and the text are ordinary
prompt tokens. Item data: {"pixel_values": float [1, C, S, S]}; crop k > 0 of an image has mm_hash `<hash>-c<k>`.
"""

from __future__ import annotations

from typing import Any

from vlserve.multimodal.inputs import MultiModalFeature

# What Gemma3Processor passes to its image processor unless told otherwise (its config keeps these null).
DEFAULT_IMAGE_KWARGS = {
    "do_convert_rgb": True,
    "do_pan_and_scan": False,
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}
# The text HF's processor writes around an image's runs (each run is wrapped in "\n\n" ... "\n\n").
BEFORE_RUN, AFTER_RUN = "\n\n", "\n\n"
ORIGINAL_INTRO = "Here is the original image "
CROPS_INTRO = " and here are some crops to help you see better "


def crop_hash(image_hash: str, k: int) -> str:
    """mm_hash of crop k of an image (k = 0: the original, the image's own hash)."""
    return image_hash if k == 0 else f"{image_hash}-c{k}"


def is_gemma3_processor(hf_processor: Any) -> bool:
    """Whether the HF processor is Gemma3Processor (matched by class name)."""
    return type(hf_processor).__name__ == "Gemma3Processor"


def gemma3_items_for(hf_processor: Any) -> Gemma3ImageItems | None:
    """The Gemma 3 rules for a Gemma3Processor, else None."""
    return Gemma3ImageItems(hf_processor) if is_gemma3_processor(hf_processor) else None


class Gemma3ImageItems:
    """Runs the Gemma3 image processor per image and expands whole prompts as Gemma3Processor does. Thread-safe
    (the memo of tokenized fixed strings is a plain dict whose worst race is tokenizing a string twice)."""

    modalities = ("image",)

    def __init__(self, hf_processor: Any) -> None:
        tok = hf_processor.tokenizer
        self.tokenizer = tok
        self.image_processor = hf_processor.image_processor
        self.seq_length = int(hf_processor.image_seq_length)
        self.boi_id = int(tok.convert_tokens_to_ids(tok.boi_token))
        self.eoi_id = int(tok.convert_tokens_to_ids(tok.eoi_token))
        self.soft_id = int(tok.convert_tokens_to_ids(tok.image_token))
        # `<start_of_image>` in the prompt names an image (5.x's processor calls it image_token_id, 4.57's not)
        self.placeholder_token_id = self.boi_id
        # where the tokenizer cuts the text before tokenizing its pieces
        self.split_ids = frozenset(int(t) for t in tok.all_special_ids) | {self.boi_id, self.eoi_id, self.soft_id}
        self._memo: dict[str, list[int]] = {}

    # ---- items ------------------------------------------------------------------------------------------------------

    def run_image(self, image: Any, kwargs: dict) -> dict:
        """One loaded image -> {"pixel_values": [1 + crops, C, S, S]} (the original first; crops only with
        pan-and-scan), split into one item per crop by `expand_prompt`."""
        out = self.image_processor(images=[image], return_tensors="pt", **{**DEFAULT_IMAGE_KWARGS, **kwargs})
        return {"pixel_values": out["pixel_values"]}  # [1 + crops, C, S, S]

    def max_image_embeds(self, mm_processor_kwargs: dict | None = None) -> int:
        """One item is one crop: image_seq_length embeddings."""
        return self.seq_length

    # ---- prompt -----------------------------------------------------------------------------------------------------

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _fixed(self, text: str) -> list[int]:
        """Token ids of a fixed string that sits between two special tokens (memoized)."""
        ids = self._memo.get(text)
        if ids is None:
            ids = self._memo[text] = self._encode(text)
        return ids

    def _segment(self, ids: list[int], lead: str, tail: str) -> list[int]:
        """A text segment's ids with `lead` / `tail` text added and the whole tokenized again (unchanged when none
        is added)."""
        if not lead and not tail:
            return list(ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) if ids else ""
        return self._encode(lead + text + tail)

    def _runs(self, image_hash: str, data: dict, out: list[int]) -> list[MultiModalFeature]:
        """Append one image's runs (and the text between them) to `out`; its features, one per crop."""
        pixels = data["pixel_values"]  # [1 + crops, C, S, S]
        features = []
        for k in range(int(pixels.shape[0])):
            if k:
                between = AFTER_RUN + (CROPS_INTRO if k == 1 else " ") + BEFORE_RUN
                out.extend(self._fixed(between))
            out.append(self.boi_id)
            # cloned: pickling one crop's data must not carry the whole image's storage along
            features.append(
                MultiModalFeature(
                    modality="image",
                    mm_hash=crop_hash(image_hash, k),
                    offset=len(out),
                    length=self.seq_length,
                    data={"pixel_values": pixels[k : k + 1].clone()},
                )
            )
            out.extend([self.soft_id] * self.seq_length)
            out.append(self.eoi_id)
        return features

    def expand_prompt(
        self, ids: list[int], items: list[tuple[int, str, str, dict]]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """Prompt ids with `<start_of_image>` at each item's position -> (expanded ids, features by offset), the ids
        as Gemma3Processor gives them for the decoded prompt. `items`: (position, modality, mm_hash, data) sorted
        by position, images only."""
        at: dict[int, tuple[str, dict]] = {}
        for pos, modality, mm_hash, data in items:
            if modality != "image":
                raise ValueError(f"Gemma 3 takes images only, not {modality!r}")
            at[pos] = (mm_hash, data)
        out: list[int] = []
        features: list[MultiModalFeature] = []
        pending: list[int] = []  # ordinary tokens of the current text segment
        lead = ""  # text the image before this segment writes at its start
        for pos, tok in enumerate(ids):
            if pos in at:
                mm_hash, data = at[pos]
                crops = int(data["pixel_values"].shape[0]) - 1
                out.extend(self._segment(pending, lead, (ORIGINAL_INTRO if crops else "") + BEFORE_RUN))
                features.extend(self._runs(mm_hash, data, out))
                pending, lead = [], AFTER_RUN
            elif tok in self.split_ids:
                out.extend(self._segment(pending, lead, ""))
                out.append(tok)
                pending, lead = [], ""
            else:
                pending.append(tok)
        out.extend(self._segment(pending, lead, ""))
        return out, features
