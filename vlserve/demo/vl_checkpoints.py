"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints (model + real HF processor) built offline for tests and demos."""

from __future__ import annotations

import os

# Images between these pixel counts become (pixels / 28**2) tokens: a few dozen at most.
TINY_MIN_PIXELS = 4 * 28 * 28
TINY_MAX_PIXELS = 64 * 28 * 28


def build_qwen2_vl_checkpoint(
    out_dir: str,
    variant: str = "qwen2_vl",
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    vision_depth: int = 2,
    vision_embed_dim: int = 32,
    vision_num_heads: int = 2,
    mrope_section: tuple[int, int, int] = (2, 3, 3),
    min_pixels: int = TINY_MIN_PIXELS,
    max_pixels: int = TINY_MAX_PIXELS,
    initializer_range: float = 0.2,
    tokens_per_second: int = 2,
    window_size: int = 56,
    fullatt_block_indexes: tuple[int, ...] = (1,),
    tie_word_embeddings: bool = False,
    seed: int = 0,
    chat_template: str | None = None,
    text_overrides: dict | None = None,
    vision_overrides: dict | None = None,
    dtype: str = "float32",
) -> str:
    """Write a random tiny Qwen2VLForConditionalGeneration (variant="qwen2_vl") or
    Qwen2_5_VLForConditionalGeneration (variant="qwen2_5_vl") plus its processor to `out_dir`; return out_dir.

    `AutoProcessor.from_pretrained(out_dir)` and `AutoModelForImageTextToText.from_pretrained(out_dir)` load it
    offline. sum(mrope_section) must equal head_dim // 2 (head_dim = hidden_size // num_attention_heads).
    Qwen2.5-VL only: `window_size` (pixels) sets windowed vision attention, `fullatt_block_indexes` the vision blocks
    that attend globally, `tokens_per_second` the temporal position scale of videos.
    `chat_template` goes to both the tokenizer and the processor (default: vlserve.demo.tokenizer.CHAT_TEMPLATE;
    tests.support.chat_templates.QWEN2_VL_CHAT_TEMPLATE behaves like the real checkpoints' template).
    `text_overrides` / `vision_overrides` replace or add fields of the text / vision config (e.g. a released
    checkpoint's vocab_size or mlp_ratio); `dtype` is the dtype the weights are initialized and saved in.
    """
    import torch
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    from vlserve.demo.tokenizer import CHAT_TEMPLATE, build_qwen2_tokenizer

    chat_template = CHAT_TEMPLATE if chat_template is None else chat_template
    head_dim = hidden_size // num_attention_heads
    if 2 * sum(mrope_section) != head_dim:
        raise ValueError(f"sum(mrope_section)={sum(mrope_section)} must be head_dim/2={head_dim // 2}")
    os.makedirs(out_dir, exist_ok=True)
    tok = build_qwen2_tokenizer(chat_template)
    ids = {
        t: tok.convert_tokens_to_ids(t)
        for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_end|>", "<|endoftext|>")
    }
    text_cfg = dict(
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
        rope_scaling={"type": "mrope", "mrope_section": list(mrope_section)},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    token_cfg = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    if variant == "qwen2_vl":
        from transformers import Qwen2VLConfig as Config
        from transformers import Qwen2VLForConditionalGeneration as Model
        from transformers import Qwen2VLProcessor as Processor

        vision_cfg = dict(
            depth=vision_depth,
            embed_dim=vision_embed_dim,
            hidden_size=hidden_size,
            num_heads=vision_num_heads,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            initializer_range=initializer_range,
        )
    elif variant == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig as Config
        from transformers import Qwen2_5_VLForConditionalGeneration as Model
        from transformers import Qwen2_5_VLProcessor as Processor

        vision_cfg = dict(
            depth=vision_depth,
            hidden_size=vision_embed_dim,
            intermediate_size=2 * vision_embed_dim,
            num_heads=vision_num_heads,
            out_hidden_size=hidden_size,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            tokens_per_second=tokens_per_second,
            window_size=window_size,
            fullatt_block_indexes=list(fullatt_block_indexes),
            hidden_act="silu",
            initializer_range=initializer_range,
        )
    else:
        raise ValueError(f"unknown variant {variant!r}; expected 'qwen2_vl' or 'qwen2_5_vl'")

    config = Config(
        text_config={**text_cfg, **(text_overrides or {})},
        vision_config={**vision_cfg, **(vision_overrides or {})},
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        **token_cfg,
    )
    config.architectures = [Model.__name__]
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # initialized in `dtype`: no float32 copy of a large model
    try:
        model = Model(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    model.save_pretrained(out_dir, safe_serialization=True)

    image_processor = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels)
    video_processor = Qwen2VLVideoProcessor(min_pixels=min_pixels, max_pixels=max_pixels)
    processor = Processor(
        image_processor=image_processor, tokenizer=tok, video_processor=video_processor, chat_template=chat_template
    )
    processor.save_pretrained(out_dir)
    return out_dir
