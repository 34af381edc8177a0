"""HF reference for the audio tests: Qwen2AudioProcessor + Qwen2AudioForConditionalGeneration greedy generate on the
waveforms vlserve decodes, and Qwen2-Audio chat prompts rendered with the checkpoint's template."""

from __future__ import annotations

import torch

from vlserve.multimodal.audio import load_audio

MAX_NEW = 8


class HFAudioOracle:
    """HF Qwen2AudioProcessor + Qwen2AudioForConditionalGeneration greedy generate (float32, CPU)."""

    def __init__(self, model_dir: str):
        from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.model = Qwen2AudioForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()

    def inputs(self, text: str, clips: list) -> dict:
        """The same mono 16 kHz waveforms vlserve decodes, through HF's processor."""
        waves = [load_audio(c, 16000).waveform for c in clips]
        return self.processor(text=[text], audio=waves or None, sampling_rate=16000, return_tensors="pt")

    def greedy(self, text: str, clips: list, n: int = MAX_NEW) -> list[int]:
        from tests.support.hf_generate import hf_greedy_ignoring_eos

        inputs = self.inputs(text, clips)
        return hf_greedy_ignoring_eos(self.model, inputs, n)[0, inputs["input_ids"].shape[1] :].tolist()


def chat_text(tok, turns: list[tuple[str, int | str]]) -> str:
    """[(role, n_clips_or_text)...] with user turns given as (n_clips, question) pairs -> the rendered prompt."""
    messages = []
    for role, content in turns:
        if role == "user":
            n, question = content
            messages.append({"role": "user", "content": [{"type": "audio"}] * n + [{"type": "text", "text": question}]})
        else:
            messages.append({"role": role, "content": content})
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
