"""Construction of the audio demo model ("vlserve-demo-audio"): its Qwen2-Audio config (tiny Whisper-style encoder +
tiny Qwen2 LM), tokenizer, processor (a real WhisperFeatureExtractor) and untrained model.

The feature extractor keeps Whisper's STFT (n_fft 400, hop 160 at 16 kHz) with 80 mel bins and a 5-second chunk
(audio_world.MAX_SECONDS) instead of 30 s: every clip is padded to 500 mel frames, so the encoder has
max_source_positions = 250 and a clip of s seconds becomes about 25 * s audio tokens (one per 40 ms).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

from vlserve.demo.audio_world import MAX_SECONDS, SAMPLE_RATE

NUM_MEL_BINS = 80
HOP_LENGTH = 160
MEL_FRAMES = int(MAX_SECONDS) * SAMPLE_RATE // HOP_LENGTH  # 500: the padded feature length
SAMPLES_PER_TOKEN = HOP_LENGTH * 4  # conv stride 2, then average pooling by 2: 640 samples (40 ms) per token
AUDIO_VOCAB_SIZE = 384

# Qwen2-Audio's chat template shape (every audio part becomes "Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>\n"; the
# processor expands <|AUDIO|> to the clip's token count) over ChatML, accepting vlserve's / OpenAI's part types too.
AUDIO_CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('audio', 'input_audio', 'audio_url') %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class AudioDemoSize:
    """Model dimensions of the encoder (encoder_*) and the LM (the rest)."""

    encoder_dim: int = 128
    encoder_layers: int = 3
    encoder_heads: int = 4
    encoder_ffn_dim: int = 512
    hidden_size: int = 192
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    tie_word_embeddings: bool = False  # HF 5.x trains Qwen2-Audio with its own lm_head: say so in the config


def audio_corpus(num_clips: int = 1000, seed: int = 0) -> list[str]:
    """ChatML-shaped Q/A lines over sampled clips (no rendering), special tokens left out."""
    from training.tokenizer import GENERIC_LINES, SYSTEM_PROMPT
    from vlserve.demo import audio_world

    rng = random.Random(seed)
    lines = []
    for _ in range(num_clips):
        for _, q, a in audio_world.qas(audio_world.sample_clip(rng)):
            lines.append(f"system\n{SYSTEM_PROMPT}\nuser\nAudio 1: \n{q}\nassistant\n{a}\n")
    return lines + GENERIC_LINES


def build_audio_tokenizer():
    """The demo tokenizer (training.tokenizer) trained on the audio world, with AUDIO_CHAT_TEMPLATE."""
    from training.tokenizer import build_demo_tokenizer

    return build_demo_tokenizer(vocab_size=AUDIO_VOCAB_SIZE, lines=audio_corpus(), chat_template=AUDIO_CHAT_TEMPLATE)


def build_audio_processor(tokenizer):
    """A Qwen2AudioProcessor: WhisperFeatureExtractor (80 mel bins, 5-s chunk) + `tokenizer` + its chat template."""
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(
        feature_size=NUM_MEL_BINS,
        sampling_rate=SAMPLE_RATE,
        hop_length=HOP_LENGTH,
        chunk_length=int(MAX_SECONDS),
        n_fft=400,
        padding_value=0.0,
    )
    return Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def build_audio_config(tokenizer, size: AudioDemoSize | None = None):
    """The Qwen2AudioConfig for `size` (default AudioDemoSize()) with the tokenizer's vocabulary and token ids."""
    from transformers import Qwen2AudioConfig

    s = size or AudioDemoSize()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|AUDIO|>", "<|im_end|>", "<|endoftext|>")}
    special = dict(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    text_cfg = dict(
        model_type="qwen2",
        vocab_size=len(tokenizer),
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=s.tie_word_embeddings,
        **special,
    )
    audio_cfg = dict(
        model_type="qwen2_audio_encoder",
        num_mel_bins=NUM_MEL_BINS,
        encoder_layers=s.encoder_layers,
        encoder_attention_heads=s.encoder_heads,
        encoder_ffn_dim=s.encoder_ffn_dim,
        d_model=s.encoder_dim,
        max_source_positions=MEL_FRAMES // 2,
        initializer_range=0.02,
    )
    config = Qwen2AudioConfig(
        audio_config=audio_cfg, text_config=text_cfg, audio_token_index=ids["<|AUDIO|>"], **special
    )
    config.tie_word_embeddings = s.tie_word_embeddings
    config.architectures = ["Qwen2AudioForConditionalGeneration"]
    config.vlserve_demo = {"size": asdict(s)}
    return config


def sinusoids(length: int, channels: int):
    """Whisper's fixed positional table [length, channels]: sines then cosines over log-spaced timescales."""
    import torch

    inv = torch.exp(-math.log(10000) / (channels // 2 - 1) * torch.arange(channels // 2))  # [channels/2]
    t = torch.arange(length)[:, None] * inv[None, :]  # [length, channels/2]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


def build_audio_model(config, seed: int = 0):
    """An untrained float32 Qwen2AudioForConditionalGeneration for `config`, initialized from `seed`; the encoder's
    (frozen) position table holds Whisper's sinusoids, as in Whisper checkpoints."""
    import torch
    from transformers import Qwen2AudioForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config).to(torch.float32)
    pos = audio_tower(model).embed_positions.weight
    with torch.no_grad():
        pos.copy_(sinusoids(pos.shape[0], pos.shape[1]))
    return model


def audio_tower(model):
    """The model's audio encoder (transformers 5.x nests it under `.model`, 4.x keeps it on the outer model)."""
    inner = getattr(model, "model", None)
    return inner.audio_tower if hasattr(inner, "audio_tower") else model.audio_tower
