"""Tiny random Mistral 3 checkpoints built offline the way HF does it (config -> model -> save_pretrained, a real
PixtralProcessor with a PixtralImageProcessor, the offline tokenizer with Pixtral's `[IMG]` / `[IMG_BREAK]` /
`[IMG_END]` tokens and a Mistral-style chat template, all saved together)."""

from __future__ import annotations

import os

IMAGE_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
# Mistral's instruction shape ("[INST]<images>text[/INST]answer</s>"), a turn's images first, then its text.
MISTRAL3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "[SYSTEM_PROMPT]{{ message['content'] if message['content'] is string else message['content'][0]['text'] }}"
    "[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url', 'image_pil') %}[IMG]{% endif %}"
    "{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}[/INST]"
    "{% else %}"
    "{{ message['content'] if message['content'] is string else message['content'][0]['text'] }}<|im_end|>"
    "{% endif %}{% endfor %}"
)

PATCH = 16
LONGEST_EDGE = 96  # with a 2x2 merge: at most 3 x 3 image tokens + 3 breaks per image


def _tokenizer():
    """The offline tokenizer plus Pixtral's image tokens (tokenizer.py's defaults untouched)."""
    from transformers import PreTrainedTokenizerFast

    from vlserve.demo.tokenizer import build_tokenizer, extra_special_tokens

    base = build_tokenizer()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=extra_special_tokens(base) + IMAGE_TOKENS,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )  # no token_type_ids: 4.57's generate rejects them
    tok.chat_template = MISTRAL3_CHAT_TEMPLATE
    return tok


def build_mistral3_checkpoint(
    out_dir: str,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    vision_width: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 2,
    spatial_merge_size: int = 2,
    longest_edge: int = LONGEST_EDGE,
    vision_feature_layer: int = -1,
    multimodal_projector_bias: bool = False,
    initializer_range: float = 0.2,
    seed: int = 0,
) -> str:
    """Write a random tiny Mistral3ForConditionalGeneration (Pixtral tower with 16-pixel patches, a Mistral
    decoder) plus its PixtralProcessor to `out_dir`; return out_dir."""
    import torch
    import transformers as tf

    os.makedirs(out_dir, exist_ok=True)
    tok = _tokenizer()
    image_id = tok.convert_tokens_to_ids("[IMG]")
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    text_cfg = dict(
        model_type="mistral",
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        head_dim=head_dim,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        sliding_window=None,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    vision_cfg = dict(
        model_type="pixtral",
        hidden_size=vision_width,
        intermediate_size=2 * vision_width,
        num_hidden_layers=vision_depth,
        num_attention_heads=vision_heads,
        num_channels=3,
        image_size=longest_edge,
        patch_size=PATCH,
        hidden_act="silu",
        initializer_range=initializer_range,
    )
    config = tf.Mistral3Config(
        vision_config=vision_cfg,
        text_config=text_cfg,
        image_token_index=image_id,
        spatial_merge_size=spatial_merge_size,
        vision_feature_layer=vision_feature_layer,
        projector_hidden_act="gelu",
        multimodal_projector_bias=multimodal_projector_bias,
        tie_word_embeddings=False,
    )
    config.architectures = ["Mistral3ForConditionalGeneration"]
    config.initializer_range = initializer_range
    torch.manual_seed(seed)
    model = tf.Mistral3ForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():  # the default init leaves biases / norms trivial: randomize them so loading is tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    image_processor = tf.PixtralImageProcessor(
        size={"longest_edge": longest_edge}, patch_size={"height": PATCH, "width": PATCH}
    )
    processor = tf.PixtralProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=PATCH,
        spatial_merge_size=spatial_merge_size,
        chat_template=MISTRAL3_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    return out_dir
