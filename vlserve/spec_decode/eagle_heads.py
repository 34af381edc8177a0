"""Untrained EAGLE draft heads sized for a target: random heads, and heads copied from the target.

`build_eagle_checkpoint(out_dir, target_dir, method, init)`:
  * init="random": normal(0, 0.02) weights (an untrained head, acceptance ~ 0);
  * init="mimic" (eagle only): fc selects the token embedding and the layer is a copy of the target's LAST
    decoder layer (with its input norm), sharing the target's final norm and lm_head. For a 1-layer target the
    draft then computes the target's own next hidden state except that its context lacks the first token
    (RoPE is relative), so most drafts are accepted, some are not; with `zero_attention=True` on a target whose
    attention output is zero (every o_proj zeroed) it reproduces the target exactly (acceptance 1).
"""

from __future__ import annotations

import torch


def _load_target(target_dir: str):
    from transformers import AutoConfig

    from vlserve.models.loader import load_model

    hf_config = AutoConfig.from_pretrained(target_dir)
    model = load_model(target_dir, hf_config, torch.float32, torch.device("cpu"))
    return hf_config, getattr(hf_config, "text_config", None) or hf_config, model


def eagle_config_for(text_cfg, method: str = "eagle", **overrides) -> dict:
    """A config.json dict sized like the target (one layer, same heads and MLP width)."""
    from vlserve.spec_decode.eagle_model import default_eagle3_layer_ids

    heads = text_cfg.num_attention_heads
    cfg = {
        "architectures": ["EagleDraftModel"],
        "method": method,
        "hidden_size": text_cfg.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text_cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads,
        "intermediate_size": text_cfg.intermediate_size,
        "rms_norm_eps": text_cfg.rms_norm_eps,
        "vocab_size": text_cfg.vocab_size,
    }
    if method == "eagle3":
        cfg["target_layer_ids"] = default_eagle3_layer_ids(text_cfg.num_hidden_layers)
    cfg.update(overrides)
    return cfg


def build_eagle_checkpoint(
    out_dir: str,
    target_dir: str,
    method: str = "eagle",
    init: str = "random",
    seed: int = 0,
    std: float = 0.02,
    **config_overrides,
) -> str:
    from vlserve.spec_decode.eagle_checkpoint import init_eagle_weights, save_eagle_draft
    from vlserve.spec_decode.eagle_model import EagleConfig, EagleDraftModel

    hf_config, text_cfg, target = _load_target(target_dir)
    overrides = dict(config_overrides)
    if init == "mimic":
        if method != "eagle":
            raise ValueError("init='mimic' builds EAGLE-1 heads only")
        overrides.setdefault("input_layernorm", True)
        overrides.setdefault("attention_bias", target_has_qkv_bias(target))
    cfg = EagleConfig.from_dict(eagle_config_for(text_cfg, method, **overrides))
    draft = EagleDraftModel(cfg, text_cfg)
    init_eagle_weights(draft, std=std, seed=seed)
    if init == "mimic":
        copy_last_layer(draft, target)
    elif init != "random":
        raise ValueError(f"init must be 'random' or 'mimic', got {init!r}")
    save_eagle_draft(draft, out_dir)
    return out_dir


def target_has_qkv_bias(target) -> bool:
    from vlserve.models.llama import decoder_of

    return decoder_of(target).layers[-1].self_attn.qkv_proj.bias is not None


@torch.no_grad()
def copy_last_layer(draft, target) -> None:
    """fc = [I, 0] (take the token embedding) and the layer = the target's last decoder layer."""
    from vlserve.models.llama import decoder_of

    H = draft.cfg.hidden_size
    src = decoder_of(target).layers[-1]
    draft.fc.weight.zero_()
    draft.fc.weight[:, :H] = torch.eye(H)
    dst = draft.layers[0]
    a = src.self_attn
    q, k, v = a.qkv_proj.weight.split([a.q_size, a.kv_size, a.kv_size], dim=0)
    dst.self_attn.q_proj.weight.copy_(q)
    dst.self_attn.k_proj.weight.copy_(k)
    dst.self_attn.v_proj.weight.copy_(v)
    if a.qkv_proj.bias is not None:
        qb, kb, vb = a.qkv_proj.bias.split([a.q_size, a.kv_size, a.kv_size])
        dst.self_attn.q_proj.bias.copy_(qb)
        dst.self_attn.k_proj.bias.copy_(kb)
        dst.self_attn.v_proj.bias.copy_(vb)
    dst.self_attn.o_proj.weight.copy_(a.o_proj.weight)
    dst.mlp.gate_up_proj.weight.copy_(src.mlp.gate_up_proj.weight)
    dst.mlp.down_proj.weight.copy_(src.mlp.down_proj.weight)
    dst.input_layernorm.weight.copy_(src.input_layernorm.weight)
    dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
