"""EAGLE draft checkpoints: random init, loading (config.json + *.safetensors, fused or HF-style names) and saving.

The format is described in `vlserve/spec_decode/eagle.py`; the model itself is `eagle_model.EagleDraftModel`.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from vlserve.spec_decode.eagle_model import EagleConfig, EagleDraftModel


def init_eagle_weights(model: EagleDraftModel, std: float = 0.02, seed: int = 0) -> None:
    """Random init (normal(0, std) linears/embeddings, ones for norms) of the draft's own parameters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def load_eagle_draft(
    path: str, target: nn.Module, target_text_config, device: torch.device, dtype: torch.dtype
) -> EagleDraftModel:
    """Read `path` (config.json + *.safetensors) into an EagleDraftModel attached to `target`."""
    from safetensors.torch import load_file

    cfg = EagleConfig.from_dir(path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"EAGLE draft: no .safetensors file in {path!r}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(os.path.join(path, f)).items():
            if name.startswith("midlayer."):  # EAGLE-3 reference checkpoints
                name = "layers.0." + name[len("midlayer.") :]
            tensors[name] = t
    tensors.pop("t2d", None)
    model = EagleDraftModel(
        cfg,
        target_text_config,
        own_embed="embed_tokens.weight" in tensors,
        own_norm="norm.weight" in tensors,
        own_lm_head="lm_head.weight" in tensors,
    )
    _split_fused(tensors, model)
    params = dict(model.named_parameters())
    params["d2t"] = model.d2t
    unexpected = sorted(set(tensors) - set(params))
    if unexpected:
        raise ValueError(f"EAGLE draft {path!r}: unexpected weights {unexpected[:10]}")
    missing = sorted(n for n in params if n not in tensors and n != "d2t")
    if missing:
        raise ValueError(f"EAGLE draft {path!r}: missing weights {missing[:10]}")
    with torch.no_grad():
        for name, t in tensors.items():
            dst = params[name]
            if tuple(dst.shape) != tuple(t.shape):
                raise ValueError(
                    f"EAGLE draft {path!r}: weight {name!r} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(t)
    ids = torch.arange(model.draft_vocab_size) + model.d2t
    if bool(((ids < 0) | (ids >= model.target_vocab_size)).any()):
        raise ValueError(
            f"EAGLE draft {path!r}: d2t maps draft ids outside the target vocabulary [0, {model.target_vocab_size})"
        )
    model = model.to(device=device, dtype=dtype)
    model.d2t = model.d2t.to(device=device, dtype=torch.long)
    model.rotary_emb.init_buffers(device=device, dtype=dtype)
    model.attach_target(target)
    return model.eval()


def _split_fused(tensors: dict[str, torch.Tensor], model: EagleDraftModel) -> None:
    """Accept fused qkv_proj / gate_up_proj tensors too (split into the HF names)."""
    attn = model.layers[0].self_attn
    for key in [k for k in tensors if ".qkv_proj." in k]:
        t = tensors.pop(key)
        q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        for n, part in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv], dim=0)):
            tensors[key.replace("qkv_proj", n)] = part
    for key in [k for k in tensors if ".gate_up_proj." in k]:
        t = tensors.pop(key)
        for n, part in zip(("gate_proj", "up_proj"), t.chunk(2, dim=0)):
            tensors[key.replace("gate_up_proj", n)] = part
    # our GatedMLP is fused: route HF gate/up names into gate_up_proj
    gu = [k for k in tensors if ".mlp.gate_proj." in k]
    for key in gu:
        up = key.replace("gate_proj", "up_proj")
        if up in tensors:
            tensors[key.replace("gate_proj", "gate_up_proj")] = torch.cat([tensors.pop(key), tensors.pop(up)], 0)


def save_eagle_draft(model: EagleDraftModel, path: str) -> None:
    """Write config.json + model.safetensors (HF-style unfused names: q/k/v/o_proj, gate/up/down_proj)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach().to("cpu").contiguous()
        if ".gate_up_proj." in name:
            g, u = t.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = g.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = u.contiguous()
        else:
            out[name] = t
    if model.eagle3 and model.draft_vocab_size != model.target_vocab_size:
        out["d2t"] = model.d2t.detach().to("cpu", torch.long).contiguous()
    save_file(out, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.cfg.to_dict(), f, indent=2)


__all__ = ["init_eagle_weights", "load_eagle_draft", "save_eagle_draft"]
