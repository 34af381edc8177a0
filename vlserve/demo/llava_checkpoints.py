"""Tiny random LLaVA-1.5 / LLaVA-NeXT checkpoints built offline the way HF does it (config -> model ->
save_pretrained, a real LlavaProcessor / LlavaNextProcessor with a CLIP or SigLIP image processor, the offline
tokenizer with an `<image>` token and a LLaVA-style chat template, all saved together)."""

from __future__ import annotations

import os

# LLaVA-1.5's conversation shape ("USER: <image>\n... ASSISTANT:"), images of a turn first, then its text.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ message['content'] if message['content'] is string else message['content'][0]['text'] }}\n"
    "{% else %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url', 'image_pil') %}<image>\n{% endif %}"
    "{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}<|im_end|>{% endif %}\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

TILE = 28  # tower input side (pixels)
PATCH = 7  # -> 4 x 4 patches per tile
# anyres resolutions (height, width): wide, tall, square and two extreme strips
GRID_PINPOINTS = ((28, 56), (56, 28), (56, 56), (28, 84), (84, 28))


def _tokenizer():
    from transformers import PreTrainedTokenizerFast

    from vlserve.demo.tokenizer import build_tokenizer, extra_special_tokens

    base = build_tokenizer()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=extra_special_tokens(base) + ["<image>"],
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )  # no token_type_ids: 4.57's generate rejects them
    tok.chat_template = LLAVA_CHAT_TEMPLATE
    return tok


def _vision_config(tower: str, width: int, depth: int) -> dict:
    common = dict(
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=depth,
        num_attention_heads=2,
        image_size=TILE,
        patch_size=PATCH,
        num_channels=3,
    )
    if tower == "clip":
        return dict(model_type="clip_vision_model", hidden_act="quick_gelu", projection_dim=width, **common)
    if tower == "siglip":
        return dict(model_type="siglip_vision_model", hidden_act="gelu_pytorch_tanh", **common)
    raise ValueError(f"unknown tower {tower!r}; expected 'clip' or 'siglip'")


def build_llava_checkpoint(
    out_dir: str,
    variant: str = "llava",
    tower: str = "clip",
    text_model: str = "llama",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    vision_width: int = 32,
    vision_depth: int = 3,
    vision_feature_layer: int | list[int] = -2,
    vision_feature_select_strategy: str | None = None,
    initializer_range: float = 0.2,
    seed: int = 0,
) -> str:
    """Write a random tiny LlavaForConditionalGeneration (variant "llava") or LlavaNextForConditionalGeneration
    ("llava_next") with a CLIP or SigLIP tower and a Llama / Qwen2 decoder (`text_model`) plus its processor to
    `out_dir`; return out_dir. The select strategy defaults to "default" for CLIP (drops the class token) and "full"
    for SigLIP (none to drop), as the real checkpoints set it."""
    import torch
    import transformers as tf

    strategy = vision_feature_select_strategy or ("default" if tower == "clip" else "full")
    os.makedirs(out_dir, exist_ok=True)
    tok = _tokenizer()
    image_id = tok.convert_tokens_to_ids("<image>")
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    text_cfg = dict(
        model_type=text_model,
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
    common = dict(
        vision_config=_vision_config(tower, vision_width, vision_depth),
        text_config=text_cfg,
        image_token_index=image_id,
        vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy=strategy,
        projector_hidden_act="gelu",
    )
    if tower == "clip":
        image_processor = tf.CLIPImageProcessor(size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE})
    else:
        image_processor = tf.SiglipImageProcessor(size={"height": TILE, "width": TILE})
    if variant == "llava":
        config, model_cls, proc_cls = tf.LlavaConfig(**common), tf.LlavaForConditionalGeneration, tf.LlavaProcessor
    elif variant == "llava_next":
        config = tf.LlavaNextConfig(image_grid_pinpoints=[list(p) for p in GRID_PINPOINTS], **common)
        model_cls, proc_cls = tf.LlavaNextForConditionalGeneration, tf.LlavaNextProcessor
        image_processor = tf.LlavaNextImageProcessor(
            size={"shortest_edge": TILE},
            crop_size={"height": TILE, "width": TILE},
            image_grid_pinpoints=[list(p) for p in GRID_PINPOINTS],
            **({} if tower == "clip" else {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}),
        )
    else:
        raise ValueError(f"unknown variant {variant!r}; expected 'llava' or 'llava_next'")
    config.architectures = [model_cls.__name__]
    config.initializer_range = initializer_range
    config.text_config.initializer_range = initializer_range
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():  # the default init leaves biases / norms trivial: randomize them so loading is tested
        for name, p in model.named_parameters():
            if name.endswith(("bias", "image_newline", "class_embedding")) or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    processor = proc_cls(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=PATCH,
        vision_feature_select_strategy=strategy,
        chat_template=LLAVA_CHAT_TEMPLATE,
        image_token="<image>",
        num_additional_image_tokens=1 if tower == "clip" else 0,
    )
    processor.save_pretrained(out_dir)
    return out_dir
