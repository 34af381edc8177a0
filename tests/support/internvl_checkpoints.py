"""Tiny random InternVL (InternVL3-style) checkpoints built offline the way HF does it (config -> model ->
save_pretrained, a real InternVLProcessor with a tiling GotOcr2ImageProcessor, the offline tokenizer with InternVL's
`<img>` / `</img>` / `<IMG_CONTEXT>` / `<video>` tokens and a ChatML template that writes `<IMG_CONTEXT>\\n` per image
and `<video>\\n` per video, an InternVLVideoProcessor that makes every frame one tile, all saved together)."""

from __future__ import annotations

import os

START, END, CONTEXT, VIDEO = "<img>", "</img>", "<IMG_CONTEXT>", "<video>"

# ChatML like InternVL3's template: every image part becomes `<IMG_CONTEXT>\n`, every video part `<video>\n`
# (InternVLProcessor writes its frames there), in the order of the parts.
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url', 'image_pil') %}<IMG_CONTEXT>\n"
    "{% elif part['type'] in ('video', 'video_url') %}<video>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TILE = 64  # tower input side (pixels)
PATCH = 16  # -> 4 x 4 patches per tile, 2 x 2 = 4 tokens per tile after the pixel shuffle
MAX_TILES = 6


def internvl_tokenizer():
    """The offline tokenizer plus InternVL's image tokens, named as InternVLProcessor reads them."""
    from transformers import Qwen2TokenizerFast

    from vlserve.demo.tokenizer import build_tokenizer, extra_special_tokens

    base = build_tokenizer()
    common = dict(
        tokenizer_object=base.backend_tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )
    named = dict(start_image_token=START, end_image_token=END, context_image_token=CONTEXT, video_token=VIDEO)
    special = extra_special_tokens(base) + [START, END, CONTEXT, VIDEO]
    if "additional_special_tokens" in Qwen2TokenizerFast.SPECIAL_TOKENS_ATTRIBUTES:
        # transformers 4.x: the special-token list is `additional_special_tokens`; named tokens (read by
        # InternVLProcessor as tok.start_image_token, ...) go in an `extra_special_tokens` dict
        tok = Qwen2TokenizerFast(**common, additional_special_tokens=special, extra_special_tokens=named)
    else:  # 5.x: named tokens are plain keyword arguments, the list is `extra_special_tokens`
        tok = Qwen2TokenizerFast(**common, **named)
        tok.add_special_tokens({"extra_special_tokens": special})
    tok.chat_template = INTERNVL_CHAT_TEMPLATE
    return tok


def internvl_vision_config(width: int = 32, depth: int = 2, **overrides) -> dict:
    """An InternVLVisionConfig dict at the tiny tile size (InternVL3-1B's choices unless overridden)."""
    cfg = dict(
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=depth,
        num_attention_heads=2,
        image_size=TILE,
        patch_size=PATCH,
        num_channels=3,
        hidden_act="gelu",
        norm_type="layer_norm",
        use_qk_norm=False,
        attention_bias=True,
        use_mean_pooling=True,
        layer_norm_eps=1e-6,
        layer_scale_init_value=0.1,
    )
    cfg.update(overrides)
    return cfg


def randomize_(model, scale: float = 0.1) -> None:
    """The default init leaves biases, norms, layer scales, the class token and positions trivial: perturb them
    so that loading and using every one of them is tested."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "lambda_1", "lambda_2", "cls_token", "position_embeddings")) or "norm" in name:
                p.add_(torch.randn_like(p) * scale)


def build_internvl_checkpoint(
    out_dir: str,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    vision_width: int = 32,
    vision_depth: int = 2,
    initializer_range: float = 0.2,
    seed: int = 0,
    **vision_overrides,
) -> str:
    """Write a random tiny InternVLForConditionalGeneration (InternViT + Qwen2 decoder) plus its InternVLProcessor
    to `out_dir`; return out_dir. Tiles are TILE pixels, at most MAX_TILES of them plus a thumbnail per image."""
    import torch
    import transformers as tf

    os.makedirs(out_dir, exist_ok=True)
    tok = internvl_tokenizer()
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
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
        tie_word_embeddings=False,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    vision_cfg = internvl_vision_config(vision_width, vision_depth, **vision_overrides)
    seq_length = (TILE // PATCH) ** 2 // 4  # downsample_ratio 0.5
    config = tf.InternVLConfig(
        vision_config=vision_cfg,
        text_config=text_cfg,
        image_token_id=tok.convert_tokens_to_ids(CONTEXT),
        image_seq_length=seq_length,
        downsample_ratio=0.5,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    config.architectures = ["InternVLForConditionalGeneration"]
    config.initializer_range = initializer_range
    config.text_config.initializer_range = initializer_range
    torch.manual_seed(seed)
    model = tf.InternVLForConditionalGeneration(config).to(torch.float32).eval()
    randomize_(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    image_processor = tf.GotOcr2ImageProcessor(
        size={"height": TILE, "width": TILE}, crop_to_patches=True, min_patches=1, max_patches=MAX_TILES
    )
    video_processor = tf.InternVLVideoProcessor(size={"height": TILE, "width": TILE})
    processor = tf.InternVLProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        image_seq_length=seq_length,
        chat_template=INTERNVL_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    return out_dir
