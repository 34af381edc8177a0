"""Construction of the demo model: its Qwen2-VL config (tiny vision tower + tiny LM), processor and untrained model.

Every image is resized to about IMAGE_TOKENS visual tokens (one per 28x28 pixels: a square image becomes a 6x6 grid,
168x168 px, whatever its size); every pair of video frames to about VIDEO_TOKENS (4x4, 112x112 px for square frames).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

TOKEN_PIXELS = 28 * 28  # one visual token after the 2x2 merge of 14-px patches
IMAGE_TOKENS = 36
VIDEO_TOKENS = 16  # per pair of frames


@dataclass
class DemoSize:
    """Model dimensions. head_dim = hidden_size / num_heads; sum(mrope_section) must be head_dim / 2."""

    hidden_size: int = 192
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    mrope_section: tuple[int, int, int] = (6, 9, 9)
    # A small base so that every M-RoPE section turns by a visible angle per row / column of a 6x6 grid (with 10000
    # the width section turns by < 0.02 rad per column and the LM cannot tell left from right).
    rope_theta: float = 10.0
    vision_depth: int = 4
    vision_embed_dim: int = 192
    vision_num_heads: int = 6
    vision_mlp_ratio: int = 2
    tie_word_embeddings: bool = True


def build_processor(tokenizer):
    """A Qwen2VLProcessor around `tokenizer` with fixed small pixel budgets for images and video frames."""
    from transformers import Qwen2VLImageProcessorFast, Qwen2VLProcessor, Qwen2VLVideoProcessor

    from vlserve.demo.tokenizer import CHAT_TEMPLATE

    # The fast (torch) image processor: what AutoProcessor loads by default, so training sees inference's pixels.
    image_processor = Qwen2VLImageProcessorFast(
        min_pixels=IMAGE_TOKENS * TOKEN_PIXELS, max_pixels=IMAGE_TOKENS * TOKEN_PIXELS
    )
    video_processor = Qwen2VLVideoProcessor(
        min_pixels=VIDEO_TOKENS * TOKEN_PIXELS, max_pixels=VIDEO_TOKENS * TOKEN_PIXELS
    )
    return Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def build_config(tokenizer, size: DemoSize | None = None):
    """The Qwen2VLConfig for `size` (default DemoSize()) with the tokenizer's vocabulary and special token ids."""
    from transformers import Qwen2VLConfig

    s = size or DemoSize()
    head_dim = s.hidden_size // s.num_heads
    if 2 * sum(s.mrope_section) != head_dim:
        raise ValueError(f"sum(mrope_section)={sum(s.mrope_section)} must be head_dim/2={head_dim // 2}")
    ids = {
        t: tokenizer.convert_tokens_to_ids(t)
        for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_end|>", "<|endoftext|>")
    }
    special = dict(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    text_cfg = dict(
        vocab_size=len(tokenizer),
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        max_position_embeddings=4096,
        rope_theta=s.rope_theta,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=s.tie_word_embeddings,
        rope_scaling={"type": "mrope", "mrope_section": list(s.mrope_section)},
        **special,
    )
    vision_cfg = dict(
        depth=s.vision_depth,
        embed_dim=s.vision_embed_dim,
        hidden_size=s.hidden_size,
        num_heads=s.vision_num_heads,
        mlp_ratio=s.vision_mlp_ratio,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        initializer_range=0.02,
    )
    config = Qwen2VLConfig(
        text_config=text_cfg,
        vision_config=vision_cfg,
        tie_word_embeddings=s.tie_word_embeddings,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        **special,
    )
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    config.vlserve_demo = {"size": asdict(s)}
    return config


def build_model(config, seed: int = 0):
    """An untrained float32 Qwen2VLForConditionalGeneration for `config`, initialized from `seed`."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config).to(torch.float32)


def count_parameters(model) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
