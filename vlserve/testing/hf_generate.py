"""HF `generate` as a greedy oracle that ignores EOS, on transformers 4.x and 5.x alike (tests only)."""
from __future__ import annotations

import torch


@torch.no_grad()
def hf_greedy_ignoring_eos(model, inputs: dict, max_new_tokens: int) -> torch.Tensor:
    """`model.generate(**inputs)` greedily for exactly `max_new_tokens` tokens with no EOS stop -> `[B, L + new]`.

    transformers 5.x fills generation options left unset (eos_token_id=None) from the model's generation config,
    and `min_new_tokens` would then mask the EOS logit; so EOS is removed from the model's own configs instead.
    """
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = model.generate(**inputs, generation_config=cfg)
    if out.shape[1] != inputs["input_ids"].shape[1] + max_new_tokens:
        raise AssertionError(f"HF generate stopped early: {out.shape[1] - inputs['input_ids'].shape[1]} of "
                             f"{max_new_tokens} tokens")
    return out
