"""A tiny random PerceptionLM checkpoint (timm-built vision tower + Llama decoder + the real HF processor), built
offline the way transformers builds one: `PerceptionLMConfig` with a `TimmWrapperConfig` vision config whose
`model_args` shrink a timm `vit_pe_core_*` architecture, saved with a PerceptionLMProcessor, an offline tokenizer
carrying `<|image|>` / `<|video|>` and a Llama-3-style chat template (PLM_CHAT_TEMPLATE).
"""

from __future__ import annotations

import os

PLM_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|image|>",
    "<|video|>",
]

# Llama-3 turns; every media part of a message is printed (as its placeholder) before the message's text, the way
# the template of the released PerceptionLM checkpoints does.
PLM_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|image|>{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'video' %}<|video|>{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}"
    "{% endif %}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def build_plm_tokenizer(vocab_size: int = 1024):
    """The offline byte-level BPE (vlserve.demo.tokenizer's corpus) with PerceptionLM's special tokens; the
    processor reads `tokenizer.image_token` / `video_token` (and their ids) from its named special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from vlserve.demo.tokenizer import _corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=PLM_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
        extra_special_tokens={"image_token": "<|image|>", "video_token": "<|video|>"},
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = PLM_CHAT_TEMPLATE
    return fast


def _image_processor(**kwargs):
    """PerceptionLMImageProcessor (transformers 5.x) or PerceptionLMImageProcessorFast (4.57 has only that one)."""
    import transformers

    cls = getattr(transformers, "PerceptionLMImageProcessor", None) or transformers.PerceptionLMImageProcessorFast
    return cls(**kwargs)


def build_plm_checkpoint(
    out_dir: str,
    architecture: str = "vit_pe_core_tiny_patch16_384",
    tile_size: int = 48,
    patch_size: int = 8,
    max_num_tiles: int = 4,
    vision_input_type: str = "thumb+tile",
    pooling_ratio: int = 2,
    vision_embed_dim: int = 32,
    vision_depth: int = 2,
    vision_num_heads: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    initializer_range: float = 0.2,
    seed: int = 0,
    model_args: dict | None = None,
) -> str:
    """Write a random tiny PerceptionLMForConditionalGeneration plus its processor to `out_dir`; return out_dir.

    Each `tile_size` tile gives (tile_size / patch_size / pooling_ratio)**2 embeddings; "thumb+tile" images are a
    thumbnail plus up to `max_num_tiles` tiles. `AutoProcessor.from_pretrained(out_dir)` and
    `AutoModelForImageTextToText.from_pretrained(out_dir)` load it offline. `model_args` adds to (or overrides)
    the timm arguments; `ref_feat_shape` (RoPE grid) is set only for the `vit_pe_*` (timm Eva) architectures.
    """
    import torch
    from transformers import (
        PerceptionLMConfig,
        PerceptionLMForConditionalGeneration,
        PerceptionLMProcessor,
        PerceptionLMVideoProcessor,
    )

    os.makedirs(out_dir, exist_ok=True)
    tok = build_plm_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in PLM_SPECIAL_TOKENS}
    grid = tile_size // patch_size
    timm_args = dict(
        embed_dim=vision_embed_dim,
        depth=vision_depth,
        num_heads=vision_num_heads,
        img_size=tile_size,
        patch_size=patch_size,
        global_pool="",
    )
    if architecture.startswith("vit_pe_"):
        timm_args["ref_feat_shape"] = (grid, grid)
    timm_args.update(model_args or {})
    vision_cfg = dict(
        model_type="timm_wrapper", architecture=architecture, do_pooling=False, num_classes=0, model_args=timm_args
    )
    text_cfg = dict(
        model_type="llama",
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=ids["<|eot_id|>"],
        pad_token_id=ids["<|end_of_text|>"],
    )
    config = PerceptionLMConfig(
        vision_config=vision_cfg,
        text_config=text_cfg,
        vision_use_cls_token=True,
        projector_pooling_ratio=pooling_ratio,
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        tie_word_embeddings=False,
    )
    config.architectures = [PerceptionLMForConditionalGeneration.__name__]
    torch.manual_seed(seed)
    model = PerceptionLMForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():  # HF's init leaves the timm tower near-identity; spread it so images matter
        for name, p in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                if p.dim() > 1:
                    p.normal_(0.0, initializer_range)
                elif name.endswith("bias"):
                    p.uniform_(-0.1, 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)

    image_processor = _image_processor(
        tile_size=tile_size,
        max_num_tiles=max_num_tiles,
        vision_input_type=vision_input_type,
        size={"height": tile_size, "width": tile_size},
    )
    video_processor = PerceptionLMVideoProcessor(size={"height": tile_size, "width": tile_size})
    processor = PerceptionLMProcessor(
        image_processor=image_processor,
        video_processor=video_processor,
        tokenizer=tok,
        patch_size=patch_size,
        pooling_ratio=pooling_ratio,
        chat_template=PLM_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    return out_dir
