"""Tiny random Qwen2-Audio checkpoints (model + real HF processor: WhisperFeatureExtractor, offline tokenizer with
the audio special tokens, a Qwen2-Audio-style chat template) built offline for tests."""

from __future__ import annotations

import os


def build_qwen2_audio_checkpoint(
    out_dir: str,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    audio_d_model: int = 32,
    audio_layers: int = 2,
    audio_heads: int = 2,
    num_mel_bins: int = 128,
    initializer_range: float = 0.2,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    chat_template: str | None = None,
) -> str:
    """Write a random tiny Qwen2AudioForConditionalGeneration plus its Qwen2AudioProcessor to `out_dir`; return it.

    The encoder keeps Whisper's 30 s window (1500 positions, 3000 mel frames) so the real feature extractor's output
    fits it. `AutoProcessor.from_pretrained(out_dir)` and `Qwen2AudioForConditionalGeneration.from_pretrained(out_dir)`
    load it offline. `chat_template` defaults to tests.support.chat_templates.QWEN2_AUDIO_CHAT_TEMPLATE.
    """
    import torch
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    from tests.support.chat_templates import QWEN2_AUDIO_CHAT_TEMPLATE
    from vlserve.demo.tokenizer import build_qwen2_tokenizer

    chat_template = QWEN2_AUDIO_CHAT_TEMPLATE if chat_template is None else chat_template
    os.makedirs(out_dir, exist_ok=True)
    tok = build_qwen2_tokenizer(chat_template)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|AUDIO|>", "<|im_end|>", "<|endoftext|>")}
    text_cfg = dict(
        model_type="qwen2",
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    audio_cfg = dict(
        model_type="qwen2_audio_encoder",
        num_mel_bins=num_mel_bins,
        d_model=audio_d_model,
        encoder_layers=audio_layers,
        encoder_attention_heads=audio_heads,
        encoder_ffn_dim=2 * audio_d_model,
        max_source_positions=1500,
        initializer_range=initializer_range,
    )
    config = Qwen2AudioConfig(
        audio_config=audio_cfg,
        text_config=text_cfg,
        audio_token_index=ids["<|AUDIO|>"],
        tie_word_embeddings=tie_word_embeddings,
    )
    config.architectures = ["Qwen2AudioForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():  # HF initialises the learned positions to zeros at random init: make them count
        pos = model.get_submodule("model.audio_tower" if hasattr(model, "model") else "audio_tower").embed_positions
        pos.weight.normal_(0.0, initializer_range)
    model.save_pretrained(out_dir, safe_serialization=True)

    extractor = WhisperFeatureExtractor(feature_size=num_mel_bins)
    processor = Qwen2AudioProcessor(feature_extractor=extractor, tokenizer=tok, chat_template=chat_template)
    processor.save_pretrained(out_dir)
    return out_dir
