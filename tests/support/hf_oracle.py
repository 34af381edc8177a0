"""HF's processor + `AutoModelForImageTextToText` greedy generate on a checkpoint: the oracle the multimodal family
tests compare vlserve with (tests only)."""

from __future__ import annotations

import base64
import io

import torch

from tests.support.hf_generate import hf_greedy_ignoring_eos


def data_url(img) -> str:
    """A PIL image as a PNG `data:` URL (an OpenAI `image_url`)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class HFImageTextOracle:
    """The checkpoint's processor (the one vlserve serves with, or plain AutoProcessor) and its HF model in float32
    on the device `LLM(device="auto")` picks; families override `video_kwargs` / `adjust` for their quirks."""

    def __init__(self, model_dir: str, max_new_tokens: int = 8, vlserve_processor: bool = True) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        from vlserve.multimodal.processor import load_hf_processor

        self.max_new_tokens = max_new_tokens
        self.processor = load_hf_processor(model_dir) if vlserve_processor else AutoProcessor.from_pretrained(model_dir)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval().to(self.device)

    def text(self, n_images: int, question: str, n_videos: int = 0) -> str:
        """A one-turn chat prompt with `n_images` images, then `n_videos` videos, then the question."""
        parts = [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos + [{"type": "text", "text": question}]
        return self.processor.apply_chat_template(
            [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
        )

    def video_kwargs(self, videos: list) -> dict:
        """Processor kwargs for raw frames: vlserve samples before processing, so the processor samples nothing."""
        return {"do_sample_frames": False}

    def adjust(self, inputs):
        """A family's correction of the processor's output (default: none)."""
        return inputs

    def inputs(self, text: str, images=None, videos=None, **kwargs):
        """The processor's output for one prompt, on the model's device."""
        if videos:
            kwargs = {**self.video_kwargs(videos), "videos": videos, **kwargs}
        inputs = self.processor(text=[text], images=images or None, return_tensors="pt", **kwargs)
        inputs.pop("token_type_ids", None)  # 4.57's tokenizer call adds it; the models take none
        return self.adjust(inputs).to(self.device)

    def run(self, text: str, images=None, videos=None, n: int | None = None, **kwargs) -> tuple[list[int], list[int]]:
        """(prompt ids after placeholder expansion, `n` greedy new tokens ignoring EOS)."""
        inputs = self.inputs(text, images, videos, **kwargs)
        prompt = inputs["input_ids"].shape[1]
        out = hf_greedy_ignoring_eos(self.model, inputs, n or self.max_new_tokens)
        return inputs["input_ids"][0].tolist(), out[0, prompt:].tolist()

    def greedy(self, text: str, images=None, videos=None, n: int | None = None, **kwargs) -> list[int]:
        """The greedy new tokens of `run`."""
        return self.run(text, images, videos, n, **kwargs)[1]
