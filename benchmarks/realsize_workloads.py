"""The workloads of `benchmarks.realsize`, prepared once for every engine: final prompt strings (chat template
applied, image placeholders in place) and uint8 images in .npy files, in three sets of the same shapes (a warm-up
of two requests, the max_tokens=1 pass, the timed pass), with the prompt token counts and image patch grids the
checkpoint's own processor gives them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven red birds sing near an old stone bridge under "
    "bright morning light and children walk slowly toward the small market to buy fresh bread apples cheese"
).split()
SET_SEEDS = {"main": 0, "ttft": 1, "warmup": 2}


@dataclass
class PreparedWorkload:
    """One workload's sets as files and strings, and the counts its FLOPs are computed from (main set)."""

    name: str
    requests: int
    max_tokens: int
    sets: dict = field(default_factory=dict)  # set name -> {"prompts": [str], "images": .npy path or None}
    prompt_lens: list[int] = field(default_factory=list)  # tokens of each main-set prompt, image placeholders in
    grids: list[tuple[int, int, int]] = field(default_factory=list)  # (t, h, w) patches of each main-set image
    image_size: int | None = None

    @property
    def max_model_len(self) -> int:
        """Room for the longest prompt and its output, and for vLLM's profiling of one largest image (1280 tokens
        at Qwen2-VL's max_pixels), rounded up to 1024."""
        need = max(self.prompt_lens) + self.max_tokens + 16
        if self.image_size:
            need = max(need, 1280 + 128)
        return -(-need // 1024) * 1024

    def child_spec(self) -> dict:
        return {"name": self.name, "max_tokens": self.max_tokens, "sets": self.sets}

    def describe(self) -> str:
        lens = f"{min(self.prompt_lens)}-{max(self.prompt_lens)}" if self.prompt_lens else "?"
        media = f", one distinct {self.image_size}x{self.image_size} image each" if self.image_size else ""
        return f"{self.requests} requests{media}, {lens} prompt tokens -> {self.max_tokens} tokens"


def words_text(rng: np.random.Generator, tokenizer, tokens: int) -> str:
    """Random words until the text is at least `tokens` tokens long."""
    text = ""
    while len(tokenizer(text, add_special_tokens=False).input_ids) < tokens:
        text += ("" if not text else " ") + WORDS[int(rng.integers(len(WORDS)))]
    return text


def exact_text(rng: np.random.Generator, tokenizer, tokens: int) -> str:
    """Random words cut to exactly `tokens` tokens (decoded, and checked to tokenize back to that many)."""
    ids = tokenizer(words_text(rng, tokenizer, tokens), add_special_tokens=False).input_ids[:tokens]
    text = tokenizer.decode(ids)
    got = len(tokenizer(text, add_special_tokens=False).input_ids)
    if got != tokens:
        raise ValueError(f"could not make a prompt of exactly {tokens} tokens (got {got})")
    return text


def prepare_image_workload(processor, out_dir: str, args) -> PreparedWorkload:
    w = PreparedWorkload("image", args.requests, args.max_tokens, image_size=args.image_size)
    for set_name, offset in SET_SEEDS.items():
        n = 2 if set_name == "warmup" else args.requests
        rng = np.random.default_rng([args.seed, offset])
        images = rng.integers(0, 256, (n, args.image_size, args.image_size, 3), dtype=np.uint8)
        prompts = []
        for _ in range(n):
            text = words_text(rng, processor.tokenizer, args.image_text_tokens)
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
            prompts.append(processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        path = os.path.join(out_dir, f"image-{set_name}.npy")
        np.save(path, images)
        w.sets[set_name] = {"prompts": prompts, "images": path}
        if set_name == "main":
            for prompt, image in zip(prompts, images):
                enc = processor(text=[prompt], images=[image], return_tensors="np")
                w.prompt_lens.append(int(enc["input_ids"].shape[1]))
                w.grids.append(tuple(int(x) for x in enc["image_grid_thw"][0]))
    return w


def prepare_text_workload(tokenizer, args) -> PreparedWorkload:
    w = PreparedWorkload("text", args.text_requests, args.text_len)
    for set_name, offset in SET_SEEDS.items():
        n = 2 if set_name == "warmup" else args.text_requests
        rng = np.random.default_rng([args.seed, offset, 1])
        w.sets[set_name] = {"prompts": [exact_text(rng, tokenizer, args.text_len) for _ in range(n)], "images": None}
    w.prompt_lens = [args.text_len] * args.text_requests
    return w


def prepare_workloads(model: str, args) -> dict[str, PreparedWorkload]:
    """The chosen workloads (args.workloads) for the checkpoint `model`, their images under args.workdir."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    out_dir = os.path.join(args.workdir, "workloads")
    os.makedirs(out_dir, exist_ok=True)
    prepared = {}
    if "image" in args.workloads:
        prepared["image"] = prepare_image_workload(processor, out_dir, args)
    if "text" in args.workloads:
        prepared["text"] = prepare_text_workload(processor.tokenizer, args)
    return prepared
