"""Tiny random HF Gemma 3 checkpoints for tests: the text model (`Gemma3ForCausalLM`, offline test tokenizer) and the
vision-language model (`Gemma3ForConditionalGeneration`, a Gemma-style tokenizer and a real `Gemma3Processor`)."""

from __future__ import annotations

import os

import torch

# 3 sliding layers then a full one (Gemma 3's pattern, shortened); the window fits in the test prompts.
DEFAULT_LAYER_TYPES = ("sliding_attention", "sliding_attention", "sliding_attention", "full_attention")


def build_gemma3_text_checkpoint(
    out_dir: str,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    layer_types: tuple[str, ...] = DEFAULT_LAYER_TYPES,
    sliding_window: int = 8,
    query_pre_attn_scalar: float = 32,
    rope_scaling: dict | None = None,
    initializer_range: float = 0.02,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config_kw,
) -> str:
    """Save a random `Gemma3ForCausalLM` (tied lm_head) with the test tokenizer to `out_dir`; returns it.

    `rope_scaling` applies to the full-attention layers (linear factor 2 by default, so both RoPE tables differ
    from plain RoPE); `query_pre_attn_scalar` defaults to 2 * head_dim so Gemma's attention scale differs from
    head_dim ** -0.5. Norm weights (applied as `1 + w`) become `0.3 * N(0,1)` instead of HF's zeros, so a loader
    or norm that drops them is caught. `config_kw` goes to Gemma3TextConfig (e.g. final_logit_softcapping).
    """
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from vlserve.demo.checkpoints import _tokenizer, save_text_checkpoint

    tok = _tokenizer()
    config = Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=len(layer_types),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        layer_types=list(layer_types),
        sliding_window=sliding_window,
        query_pre_attn_scalar=query_pre_attn_scalar,
        max_position_embeddings=512,
        rope_scaling=dict(rope_scaling or {"rope_type": "linear", "factor": 2.0}),
        initializer_range=initializer_range,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **config_kw,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return save_text_checkpoint(model, tok, out_dir, dtype)


# ---- Gemma 3 vision-language (Gemma3ForConditionalGeneration) -------------------------------------------------------

# Gemma's special tokens at Gemma's low ids (<pad> 0, <eos> 1, <bos> 2), then the turn and image tokens.
GEMMA_SPECIAL_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
# How Gemma3Processor finds its image tokens (tokenizer attributes `boi_token`, `eoi_token`, `image_token`).
GEMMA_IMAGE_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
# Gemma 3's turn shape: a system message folds into the first user turn, the assistant is "model", an image part
# is `<start_of_image>` in the text (the processor expands it), text parts are trimmed.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(prefix='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set ns.prefix = (message['content'] if message['content'] is string "
    "else message['content'][0]['text']) + '\n\n' %}"
    "{% else %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n{{ ns.prefix }}"
    "{% set ns.prefix = '' %}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url', 'image_pil') %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# 2 sliding layers around a full one; the window holds one image run (16 soft tokens) and a few more tokens.
VLM_LAYER_TYPES = ("sliding_attention", "full_attention", "sliding_attention")


def gemma_tokenizer():
    """A byte-level BPE tokenizer with Gemma's special tokens, trained on the offline corpus with newline runs in
    it (so "\\n\\n" / "\\n\\n\\n" are tokens of their own, as in Gemma's vocabulary, and the text around an image's
    run tokenizes differently when written whole), no automatic BOS (the chat template writes it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from vlserve.demo.tokenizer import _corpus

    lines = _corpus(2000)
    corpus = [a + "\n" * (1 + i % 3) + b for i, (a, b) in enumerate(zip(lines, lines[1:]))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=GEMMA_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=GEMMA_SPECIAL_TOKENS[4:],
        extra_special_tokens=dict(GEMMA_IMAGE_TOKENS),
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )
    fast.chat_template = GEMMA3_CHAT_TEMPLATE
    return fast


def build_gemma3_vlm_checkpoint(
    out_dir: str,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    layer_types: tuple[str, ...] = VLM_LAYER_TYPES,
    sliding_window: int = 20,
    vision_width: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 2,
    image_size: int = 32,
    patch_size: int = 4,
    mm_tokens_per_image: int = 16,
    final_logit_softcapping: float | None = 30.0,
    initializer_range: float = 0.02,
    seed: int = 0,
) -> str:
    """Save a random tiny `Gemma3ForConditionalGeneration` (SigLIP tower over an (image_size / patch_size)^2 patch
    grid pooled to `mm_tokens_per_image` tokens, a Gemma 3 decoder with mixed layer types, tied lm_head) and its
    real `Gemma3Processor` (Gemma3 image processor, `gemma_tokenizer`, Gemma-style chat template) to `out_dir`.

    Norm weights and the projector matrix (HF initializes both to zeros) become random so nothing is trivial."""
    import transformers as tf

    from vlserve.demo.checkpoints import save_text_checkpoint

    os.makedirs(out_dir, exist_ok=True)
    tok = gemma_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in GEMMA_SPECIAL_TOKENS}
    text_cfg = dict(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=len(layer_types),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        layer_types=list(layer_types),
        sliding_window=sliding_window,
        query_pre_attn_scalar=2 * head_dim,
        max_position_embeddings=1024,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        final_logit_softcapping=final_logit_softcapping,
        initializer_range=initializer_range,
        tie_word_embeddings=True,
        bos_token_id=ids["<bos>"],
        eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]],
        pad_token_id=ids["<pad>"],
    )
    vision_cfg = dict(
        model_type="siglip_vision_model",
        hidden_size=vision_width,
        intermediate_size=2 * vision_width,
        num_hidden_layers=vision_depth,
        num_attention_heads=vision_heads,
        num_channels=3,
        image_size=image_size,
        patch_size=patch_size,
        vision_use_head=False,
        layer_norm_eps=1e-6,
    )
    config = tf.Gemma3Config(
        text_config=text_cfg,
        vision_config=vision_cfg,
        mm_tokens_per_image=mm_tokens_per_image,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        initializer_range=initializer_range,
        tie_word_embeddings=True,
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mm_input_projection_weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * vision_width**-0.5)
    save_text_checkpoint(model, tok, out_dir, torch.float32)
    image_processor = tf.Gemma3ImageProcessor(size={"height": image_size, "width": image_size})
    processor = tf.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        image_seq_length=mm_tokens_per_image,
        chat_template=GEMMA3_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    return out_dir
