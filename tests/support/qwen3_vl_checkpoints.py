"""Tiny random Qwen3-VL checkpoints (model + real HF processor) built offline for tests and demos."""

from __future__ import annotations

import os

# Images between these pixel counts become (pixels / 32**2) tokens: a few dozen at most (16-pixel patches, 2x2 merge).
TINY_MIN_PIXELS = 4 * 32 * 32
TINY_MAX_PIXELS = 48 * 32 * 32


def build_qwen3_vl_checkpoint(
    out_dir: str,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 3,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    vision_depth: int = 3,
    vision_hidden_size: int = 32,
    vision_num_heads: int = 2,
    deepstack_visual_indexes: tuple[int, ...] = (0, 1),
    num_position_embeddings: int = 16,
    mrope_section: tuple[int, int, int] = (2, 3, 3),
    min_pixels: int = TINY_MIN_PIXELS,
    max_pixels: int = TINY_MAX_PIXELS,
    initializer_range: float = 0.2,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    chat_template: str | None = None,
    moe: dict | None = None,
) -> str:
    """Write a random tiny Qwen3VLForConditionalGeneration plus its processor (Qwen2VL image processor, Qwen3VL
    video processor, the offline Qwen-style tokenizer) to `out_dir`; return out_dir.

    sum(mrope_section) must equal head_dim // 2; the text layers get DeepStack features from the vision blocks in
    `deepstack_visual_indexes` (one per decoder layer, from layer 0), so there must be at most `num_layers` of them.
    `num_position_embeddings` (a square) sizes the learned position grid the tower resamples to every image.
    `moe` (e.g. {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48}, optionally
    "decoder_sparse_step" / "mlp_only_layers") builds a Qwen3VLMoeForConditionalGeneration instead.
    """
    import torch
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    if moe:
        from transformers import Qwen3VLMoeConfig as Config
        from transformers import Qwen3VLMoeForConditionalGeneration as Model
    else:
        from transformers import Qwen3VLConfig as Config
        from transformers import Qwen3VLForConditionalGeneration as Model

    from vlserve.demo.tokenizer import CHAT_TEMPLATE, build_qwen2_tokenizer

    chat_template = CHAT_TEMPLATE if chat_template is None else chat_template
    if 2 * sum(mrope_section) != head_dim:
        raise ValueError(f"sum(mrope_section)={sum(mrope_section)} must be head_dim/2={head_dim // 2}")
    if len(deepstack_visual_indexes) > num_layers:
        raise ValueError(f"{len(deepstack_visual_indexes)} DeepStack levels need at least as many decoder layers")
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
        head_dim=head_dim,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=10000.0,  # the 4.57 spelling; 5.x folds both into rope_parameters
        rope_scaling={"rope_type": "default", "mrope_section": list(mrope_section), "mrope_interleaved": True},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        **(moe or {}),
    )
    vision_cfg = dict(
        depth=vision_depth,
        hidden_size=vision_hidden_size,
        intermediate_size=2 * vision_hidden_size,
        num_heads=vision_num_heads,
        out_hidden_size=hidden_size,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=num_position_embeddings,
        deepstack_visual_indexes=list(deepstack_visual_indexes),
        hidden_act="gelu_pytorch_tanh",
        initializer_range=initializer_range,
    )
    config = Config(
        text_config=text_cfg,
        vision_config=vision_cfg,
        tie_word_embeddings=tie_word_embeddings,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    config.architectures = [Model.__name__]
    torch.manual_seed(seed)
    model = Model(config).to(torch.float32).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    if moe:
        _write_released_expert_layout(out_dir, int(moe["moe_intermediate_size"]))
        # the released configs state the renormalized top-k (HF's Qwen3-VL-MoE always renormalizes; vLLM reads it)
        import json

        path = os.path.join(out_dir, "config.json")
        saved = json.load(open(path))
        saved["text_config"].setdefault("norm_topk_prob", True)
        with open(path, "w") as f:
            json.dump(saved, f, indent=2)

    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    image_processor = Qwen2VLImageProcessor(size=size, patch_size=16, merge_size=2)
    video_processor = Qwen3VLVideoProcessor(size=size, patch_size=16, merge_size=2)
    processor = Qwen3VLProcessor(
        image_processor=image_processor, tokenizer=tok, video_processor=video_processor, chat_template=chat_template
    )
    processor.save_pretrained(out_dir)
    return out_dir


def _write_released_expert_layout(out_dir: str, moe_intermediate_size: int) -> None:
    """Store the stacked experts as the released checkpoints (and transformers 4.57, and vLLM) do:
    `gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`; transformers 5.x saves them transposed (it reads both)."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    changed = False
    for name, t in tensors.items():
        if (
            name.endswith("experts.gate_up_proj")
            and t.shape[1] == 2 * moe_intermediate_size
            or name.endswith("experts.down_proj")
            and t.shape[2] == moe_intermediate_size
        ):
            tensors[name] = t.transpose(1, 2).contiguous()
            changed = True
    if changed:
        save_file(tensors, path, metadata={"format": "pt"})


def trained_video_layout(inputs: dict, vision_start_id: int, vision_end_id: int, image_id: int, video_id: int) -> dict:
    """HF processor output -> the same with every video in the layout Qwen3-VL was trained on (and transformers
    4.57 writes): transformers 5.x keeps the chat template's outer `<|vision_start|>` / `<|vision_end|>` around a
    video's per-frame runs, which bring their own pairs; those outer two tokens are dropped (input_ids,
    attention_mask, and mm_token_type_ids recomputed: 1 image pad, 2 video pad). Unchanged when nothing is nested."""
    import torch

    ids = inputs["input_ids"][0].tolist()
    drop, opened = set(), []  # indexes of the outer pair's tokens; vision_start positions not yet closed
    for i, t in enumerate(ids):
        if t == vision_start_id:
            opened.append(i)
        elif t == vision_end_id and opened:
            opened.pop()
            if len(opened) == 1 and i + 1 < len(ids) and ids[i + 1] == vision_end_id:
                drop.update((opened.pop(), i + 1))
    if not drop:
        return inputs
    keep = torch.tensor([i not in drop for i in range(len(ids))])
    out = dict(inputs)
    out["input_ids"] = inputs["input_ids"][:, keep]
    if "attention_mask" in inputs:
        out["attention_mask"] = inputs["attention_mask"][:, keep]
    if "mm_token_type_ids" in inputs:
        kept = out["input_ids"]
        out["mm_token_type_ids"] = ((kept == image_id).long() + 2 * (kept == video_id).long()).to(
            inputs["mm_token_type_ids"].dtype
        )
    return out
