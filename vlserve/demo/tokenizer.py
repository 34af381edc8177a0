"""An offline byte-level BPE tokenizer with Qwen-style special tokens and a ChatML chat template.

Tests and the demo model use it instead of a downloaded tokenizer. Training depends only on its corpus,
so the same call always yields the same vocabulary.
"""

from __future__ import annotations

import os

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|AUDIO|>",
]

# ChatML with Qwen2-VL's media placeholders: every image part becomes
# <|vision_start|><|image_pad|><|vision_end|> (the HF processor expands the pad to the image's token count).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url', 'image_pil') %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] in ('video', 'video_url') %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] in ('input_audio', 'audio', 'audio_url') %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "the a an of to in is it that this what where which how many there are image video picture shape color "
    "circle square triangle red green blue yellow purple orange white black left right up down top bottom "
    "center moves move moving describe one two three four five six seven eight nine ten and with on at "
    "you i we they he she hello world model serve token fast cache block request answer question small "
    "large big tiny frame clip audio sound language vision engine batch prefix decode prefill quick brown "
    "fox jumps over lazy dog number zero yes no please thank assistant user system helpful"
).split()


def _corpus(num_lines: int = 4000) -> list[str]:
    """A deterministic pseudo-English corpus (a linear congruential walk over a word list)."""
    lines, state = [], 12345
    for _ in range(num_lines):
        words = []
        for _ in range(12):
            state = (1103515245 * state + 12345) % (2**31)
            words.append(_WORDS[(state >> 16) % len(_WORDS)])
        lines.append(" ".join(words).capitalize() + ". 0123456789 ?!,")
    return lines


def extra_special_tokens(tokenizer) -> list[str]:
    """The tokenizer's added special tokens beyond eos/pad/bos/unk, on transformers 4.x
    (`additional_special_tokens`) and 5.x (`extra_special_tokens`) alike."""
    for name in ("additional_special_tokens", "extra_special_tokens"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, (list, tuple)) and value:
            return [str(t) for t in value]
    return []


def build_tokenizer(out_dir: str | None = None, vocab_size: int = 1024):
    """Train the tokenizer and return a `PreTrainedTokenizerFast`; also save it to out_dir when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        fast.save_pretrained(out_dir)
    return fast


def build_qwen2_tokenizer(chat_template: str | None = None):
    """The offline tokenizer wrapped in a `Qwen2TokenizerFast` (the Qwen processors insist on that class), with
    `chat_template` (default CHAT_TEMPLATE)."""
    from transformers import Qwen2TokenizerFast

    base = build_tokenizer()
    tok = Qwen2TokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=extra_special_tokens(base),
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE if chat_template is None else chat_template
    return tok
