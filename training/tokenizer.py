"""The demo model's domain tokenizer: byte-level BPE trained with `tokenizers` on the world's questions and answers
wrapped in ChatML, with Qwen2-VL's special tokens and chat template (shared with vlserve.demo.tokenizer).

Every byte is in the alphabet, so any text encodes; the world's words are single tokens. Training depends only on
a seeded corpus, so the vocabulary is reproducible.
"""

from __future__ import annotations

import random

from vlserve.demo.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS

DEFAULT_VOCAB_SIZE = 512
SYSTEM_PROMPT = "You are a helpful assistant."
# A little generic text so common words outside the world still merge sensibly.
GENERIC_LINES = ["Hello! How are you? I am fine, thank you. What is this? Yes. No. 0 1 2 3 4 5 6 7 8 9"] * 20


def corpus(num_scenes: int = 1000, seed: int = 0) -> list[str]:
    """ChatML-shaped Q/A lines over sampled scenes and clips (no rendering), special tokens left out."""
    from vlserve.demo import world

    rng = random.Random(seed)
    lines = []
    for i in range(num_scenes):
        scene = world.sample_video(rng) if i % 3 == 2 else world.sample_scene(rng)
        for form, q, a in world.qas(scene):
            if form == "json":  # added after the demo model shipped: leaving it out keeps the vocabulary its own
                continue
            # The chat template's text between special tokens (they are atomic, so they stay out of training).
            lines.append(f"system\n{SYSTEM_PROMPT}\nuser\n{q}\nassistant\n{a}\n")
    return lines + GENERIC_LINES


def build_demo_tokenizer(
    out_dir: str | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    lines: list[str] | None = None,
    chat_template: str = CHAT_TEMPLATE,
):
    """Train the tokenizer on `lines` (default: the vision world's `corpus()`); return it as a `Qwen2TokenizerFast`
    (the class the Qwen2-VL and Qwen2-Audio processors expect) with `chat_template`, eos `<|im_end|>` and pad
    `<|endoftext|>`; also save it to out_dir when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus() if lines is None else lines, trainer=trainer)
    fast = Qwen2TokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template
    if out_dir is not None:
        fast.save_pretrained(out_dir)
    return fast
