"""Tiny random HF checkpoints (config + safetensors + tokenizer + generation_config) for tests and demos."""

from __future__ import annotations

import functools
import os

import torch

_ARCHS = ("llama", "qwen2", "qwen3")
# Default tie_word_embeddings per arch (small Qwen models tie; Llama does not).
_DEFAULT_TIE = {"llama": False, "qwen2": True, "qwen3": True}


@functools.lru_cache(maxsize=1)
def _tokenizer():
    """The offline test tokenizer, trained once per process."""
    from vlserve.demo.tokenizer import build_tokenizer

    return build_tokenizer()


THINK_TAGS = ("<think>", "</think>")


def thinking_tokenizer(tok):
    """A copy of `tok` with Qwen3's thinking tags as added tokens (one id each, kept when special tokens are
    skipped, as in Qwen3's tokenizer) and a chat template with Qwen3's thinking switch: the generation prompt opens
    `<think>` (the model reasons first), and `enable_thinking=False` closes an empty `<think>\n\n</think>\n\n`."""
    import copy

    from tokenizers import AddedToken

    from vlserve.demo.tokenizer import CHAT_TEMPLATE

    tok = copy.deepcopy(tok)
    tok.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in THINK_TAGS])
    prompt = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    assert CHAT_TEMPLATE.endswith(prompt)
    tok.chat_template = CHAT_TEMPLATE[: -len(prompt)] + (
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
        "{% else %}<think>\n{% endif %}{% endif %}"
    )
    return tok


def _make_config(arch: str, **kw):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if arch == "llama":
        return LlamaConfig(**kw)
    if arch == "qwen2":
        return Qwen2Config(**kw)
    if arch == "qwen3":
        return Qwen3Config(head_dim=kw["hidden_size"] // kw["num_attention_heads"], **kw)
    raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(_ARCHS)}")


def build_text_checkpoint(
    out_dir: str,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    tie_word_embeddings: bool | None = None,
    initializer_range: float = 0.2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_position_embeddings: int = 2048,
    rope_scaling: dict | None = None,
    randomize_norms_and_biases: bool = True,
    attention_bias: bool = False,
    tokenizer_dir: str | None = None,
    thinking: bool = False,
) -> str:
    """Save a random `arch` ("llama" | "qwen2" | "qwen3") HF causal LM with the test tokenizer to `out_dir`.

    vocab_size defaults to `len(tokenizer)`; tie_word_embeddings defaults to True for Qwen, False for Llama.
    The large `initializer_range` makes greedy outputs change from token to token. With
    `randomize_norms_and_biases` the RMSNorm weights become `1 + 0.1 * N(0,1)` and linear biases
    `N(0, initializer_range)` (HF initializes them to 1 and 0), so loaders that drop them are caught.
    config.json carries eos/pad ids of the tokenizer (eos = <|im_end|>, pad = <|endoftext|>), as does
    generation_config.json. `attention_bias` (llama, qwen3) adds biases to q/k/v/o_proj. `tokenizer_dir`: a local
    tokenizer to ship instead of the test one (e.g. `tests.support.tekken_tokenizer`'s). `thinking`: the tokenizer
    gets `<think>` / `</think>` and a thinking chat template (`thinking_tokenizer`). Returns `out_dir`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else _tokenizer()
    if thinking:
        tok = thinking_tokenizer(tok)
    vocab_size = vocab_size or len(tok)
    tie = _DEFAULT_TIE[arch] if tie_word_embeddings is None and arch in _DEFAULT_TIE else tie_word_embeddings
    config = _make_config(
        arch,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=bool(tie),
        initializer_range=initializer_range,
        max_position_embeddings=max_position_embeddings,
        rope_scaling=rope_scaling,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **({"attention_bias": True} if attention_bias else {}),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if randomize_norms_and_biases:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                elif name.endswith(".bias"):
                    p.copy_(initializer_range * torch.randn(p.shape, generator=gen))
    return save_text_checkpoint(model, tok, out_dir, dtype)


def save_text_checkpoint(model, tok, out_dir: str, dtype) -> str:
    """Cast `model` to `dtype`, give it a generation config with the tokenizer's EOS / pad, and save both to
    `out_dir` (safetensors); returns out_dir."""
    from transformers import GenerationConfig

    model = model.to(dtype)
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return str(out_dir)
