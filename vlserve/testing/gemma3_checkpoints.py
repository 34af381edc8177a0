"""A tiny random HF Gemma 3 text checkpoint (`Gemma3ForCausalLM`) with the offline test tokenizer, for tests."""
from __future__ import annotations

import torch

# 3 sliding layers then a full one (Gemma 3's pattern, shortened); the window fits in the test prompts.
DEFAULT_LAYER_TYPES = ("sliding_attention", "sliding_attention", "sliding_attention", "full_attention")


def build_gemma3_text_checkpoint(out_dir: str, hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                                 head_dim: int = 16, intermediate_size: int = 128,
                                 layer_types: tuple[str, ...] = DEFAULT_LAYER_TYPES, sliding_window: int = 8,
                                 query_pre_attn_scalar: float = 32, rope_scaling: dict | None = None,
                                 initializer_range: float = 0.02, seed: int = 0,
                                 dtype: torch.dtype = torch.float32, **config_kw) -> str:
    """Save a random `Gemma3ForCausalLM` (tied lm_head) with the test tokenizer to `out_dir`; returns it.

    `rope_scaling` applies to the full-attention layers (linear factor 2 by default, so both RoPE tables differ
    from plain RoPE); `query_pre_attn_scalar` defaults to 2 * head_dim so Gemma's attention scale differs from
    head_dim ** -0.5. Norm weights (applied as `1 + w`) become `0.3 * N(0,1)` instead of HF's zeros, so a loader
    or norm that drops them is caught. `config_kw` goes to Gemma3TextConfig (e.g. final_logit_softcapping).
    """
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from vlserve.testing.checkpoints import _tokenizer, save_text_checkpoint

    tok = _tokenizer()
    config = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=len(layer_types), num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, layer_types=list(layer_types), sliding_window=sliding_window,
        query_pre_attn_scalar=query_pre_attn_scalar, max_position_embeddings=512,
        rope_scaling=dict(rope_scaling or {"rope_type": "linear", "factor": 2.0}),
        initializer_range=initializer_range, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **config_kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return save_text_checkpoint(model, tok, out_dir, dtype)
