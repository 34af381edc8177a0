"""The EAGLE / EAGLE-3 draft head: one Llama-style decoder layer over the target's hidden states.

Checkpoint: a directory with `config.json` + `model.safetensors` (format in `vlserve/spec_decode/eagle.py`).

EAGLE-1 (`method: "eagle"`), per token at position p (the draft's row p):
    x   = fc(cat[embed(token[p+1]); h_target[p]])                 fc: [H, 2H]
          (with "fc_input_norm": fc(cat[enorm(embed); hnorm(h)]), RMSNorms with weights)
    out = x + attn(ln_in(x)) ; out = out + mlp(ln_post(out))      (ln_in only with "input_layernorm": true)
    logits = lm_head(norm(out))                                   -> token[p+2]
  h_target is the target's final residual stream before its last norm ("target_hidden": "pre_norm", default) or
  the normed output ("post_norm", original EAGLE checkpoints, then usually "final_norm": false).
EAGLE-3 (`method: "eagle3"`):
    h   = fc(cat[a_low; a_mid; a_high])  for target rows (fc: [H, 3H]); the draft's own `out` for later steps
          (with "fc_input_norm": each a_* RMS-normalized on its own, then times hnorm.weight [3H])
    out = h + attn(cat[ln_in(embed(token[p+1])); hidden_norm(h)]) ; out = out + mlp(ln_post(out))   (qkv: [.., 2H])
    logits = lm_head(norm(out)) over the draft vocabulary; target id = draft id + d2t[draft id]
Later draft steps feed `out` back as the hidden input (EAGLE-1: through fc again; EAGLE-3: straight in).

`embed_tokens`, `norm` and `lm_head` are the target's own unless the checkpoint carries them. They are held by
reference (not registered), so the draft's state_dict holds only the draft's own weights.

Two attention paths share the weights: paged (`forward`, the serving path, one KV cache over the target's block
tables) and dense (`forward_train`, whole padded sequences with EAGLE-3 "training-time test" unrolling).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vlserve import kernels
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.kernels.rotary_ref import rotary_cos_sin
from vlserve.models.layers import GatedMLP, RMSNorm, RotaryEmbedding

ARCHITECTURE = "EagleDraftModel"
METHODS = ("eagle", "eagle3")


def default_eagle3_layer_ids(num_layers: int) -> list[int]:
    """vLLM's low/mid/high choice (inputs of layers 2, L/2, L-3) for deep targets; [0, L/2, L] for shallow ones."""
    if num_layers >= 6:
        return [2, num_layers // 2, num_layers - 3]
    return [0, num_layers // 2, num_layers]


@dataclass
class EagleConfig:
    """`config.json` of a draft checkpoint (unknown keys are kept in `extra`)."""

    method: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    head_dim: int | None = None
    hidden_act: str = "silu"
    attention_bias: bool = False
    fc_bias: bool = False
    fc_input_norm: bool = False  # RMSNorm each fc input part first (enorm / hnorm weights): scale-free inputs
    input_layernorm: bool | None = None  # eagle: default False (EAGLE-1 drops it); eagle3: always on
    target_hidden: str = "pre_norm"  # eagle only: "pre_norm" | "post_norm"
    final_norm: bool = True  # apply norm (own or the target's) before lm_head
    target_layer_ids: list[int] | None = None  # eagle3: the three target layers whose input states are fused
    draft_vocab_size: int | None = None  # eagle3: None = the target's vocabulary
    vocab_size: int | None = None  # the target's vocabulary (informational; checked when present)
    num_hidden_layers: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"EAGLE config: method must be one of {list(METHODS)}, got {self.method!r}")
        if self.num_hidden_layers != 1:
            raise ValueError(
                f"EAGLE config: only 1-layer draft heads are supported, got num_hidden_layers={self.num_hidden_layers}"
            )
        if self.target_hidden not in ("pre_norm", "post_norm"):
            raise ValueError(
                f"EAGLE config: target_hidden must be 'pre_norm' or 'post_norm', got {self.target_hidden!r}"
            )
        if self.input_layernorm is None:
            self.input_layernorm = self.method == "eagle3"
        if self.method == "eagle3" and not self.input_layernorm:
            raise ValueError("EAGLE config: eagle3 heads always have input_layernorm")
        if self.method == "eagle3" and self.target_layer_ids is not None and len(self.target_layer_ids) != 3:
            raise ValueError(f"EAGLE config: eagle3 needs exactly 3 target_layer_ids, got {self.target_layer_ids}")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict) -> EagleConfig:
        d = dict(d)
        arch = d.pop("architectures", [ARCHITECTURE])
        if not arch or arch[0] != ARCHITECTURE:
            raise ValueError(f"EAGLE draft config: architectures must be [{ARCHITECTURE!r}], got {arch!r}")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        missing = [
            k
            for k in ("method", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size")
            if k not in d
        ]
        if missing:
            raise ValueError(f"EAGLE draft config: missing {missing}")
        extra = {k: d.pop(k) for k in list(d) if k not in known}
        return cls(**d, extra=extra)

    @classmethod
    def from_dir(cls, path: str) -> EagleConfig:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"EAGLE draft: no config.json in {path!r}")
        with open(cfg_path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict:
        out = {"architectures": [ARCHITECTURE]}
        for k in self.__dataclass_fields__:
            if k != "extra" and getattr(self, k) is not None:
                out[k] = getattr(self, k)
        if self.method == "eagle":
            out.pop("target_layer_ids", None)
            out.pop("draft_vocab_size", None)
        else:
            out.pop("target_hidden", None)
        out.update(self.extra)
        return out

    def layer_config(self, target_text_config):
        """A config object for RotaryEmbedding/GatedMLP: the target's rope settings with the draft's sizes."""
        cfg = copy.copy(target_text_config)
        per_type = getattr(cfg, "rope_parameters", None)
        if isinstance(per_type, dict) and isinstance(per_type.get("full_attention"), dict):
            # RoPE per layer type (Gemma 3 on transformers 5.x): the draft attends the whole context, so it takes
            # the full-attention layers' RoPE, as 4.x configs give it
            cfg.rope_parameters = dict(per_type["full_attention"])
        for k in ("rope_theta", "rope_scaling", "max_position_embeddings"):
            if k in self.extra:
                setattr(cfg, k, self.extra[k])
        cfg.hidden_size = self.hidden_size
        cfg.num_attention_heads = self.num_attention_heads
        cfg.num_key_value_heads = self.num_key_value_heads
        cfg.head_dim = self.head_dim
        cfg.intermediate_size = self.intermediate_size
        cfg.rms_norm_eps = self.rms_norm_eps
        cfg.num_hidden_layers = 1
        return cfg


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Out-of-place NeoX rotary (autograd-friendly): x [T, h, D], cos/sin [T, R/2]."""
    half = cos.shape[-1]
    cos = cos.to(x.dtype).unsqueeze(1)
    sin = sin.to(x.dtype).unsqueeze(1)
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class EagleAttention(nn.Module):
    """q/k/v/o projections (HF names), RoPE (M-RoPE when positions are [3, T]), paged or dense attention."""

    def __init__(self, cfg: EagleConfig, in_dim: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.scale = self.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.rotary = [rotary]

    def qkv(self, x: torch.Tensor):
        T = x.shape[0]
        return (
            self.q_proj(x).view(T, self.num_heads, self.head_dim),
            self.k_proj(x).view(T, self.num_kv_heads, self.head_dim),
            self.v_proj(x).view(T, self.num_kv_heads, self.head_dim),
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache, md: AttentionMetadata) -> torch.Tensor:
        """Paged: x [T, in] -> [T, H]; writes K/V at md.slot_mapping."""
        q, k, v = self.qkv(x)
        self.rotary[0](positions, q, k)  # in place
        out = kernels.attention_forward(q, k, v, kv_cache[0], kv_cache[1], md, self.scale)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def rope_dense(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        rot = self.rotary[0]
        mrope = rot.mrope_section if positions.dim() == 2 else None
        cos, sin = rotary_cos_sin(positions, rot.cos_cache, rot.sin_cache, mrope)
        return _rope(q, cos, sin), _rope(k, cos, sin)


class EagleDecoderLayer(nn.Module):
    """The draft's decoder layer (EAGLE-1: plain Llama block; EAGLE-3: attention over [embeds; hidden])."""

    def __init__(self, cfg: EagleConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.eagle3 = cfg.method == "eagle3"
        H = cfg.hidden_size
        self.self_attn = EagleAttention(cfg, 2 * H if self.eagle3 else H, rotary)
        self.mlp = GatedMLP(H, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps) if cfg.input_layernorm else None
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps) if self.eagle3 else None
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)

    def attn_input(self, embeds: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: the residual stream entering the layer (EAGLE-1: fc output; EAGLE-3: fused hidden)."""
        if self.eagle3:
            return torch.cat([self.input_layernorm(embeds), self.hidden_norm(x)], dim=-1)
        return self.input_layernorm(x) if self.input_layernorm is not None else x

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h, residual = self.post_attention_layernorm(attn_out, residual)
        return self.mlp(h) + residual


class EagleDraftModel(nn.Module):
    """Draft head; see the module docstring. `target` supplies shared embeddings / norm / lm_head."""

    def __init__(
        self,
        cfg: EagleConfig,
        target_text_config,
        *,
        own_embed: bool = False,
        own_norm: bool = False,
        own_lm_head: bool = False,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.eagle3 = cfg.method == "eagle3"
        H = cfg.hidden_size
        if H != target_text_config.hidden_size:
            raise ValueError(f"EAGLE draft hidden_size {H} != target hidden_size {target_text_config.hidden_size}")
        self.target_vocab_size = target_text_config.vocab_size
        if cfg.vocab_size is not None and cfg.vocab_size != self.target_vocab_size:
            raise ValueError(
                f"EAGLE draft was built for a vocabulary of {cfg.vocab_size} tokens, the target has "
                f"{self.target_vocab_size}"
            )
        self.draft_vocab_size = (
            (cfg.draft_vocab_size or self.target_vocab_size) if self.eagle3 else self.target_vocab_size
        )
        lcfg = cfg.layer_config(target_text_config)
        self.rotary_emb = RotaryEmbedding(lcfg)
        self.fc = nn.Linear((3 if self.eagle3 else 2) * H, H, bias=cfg.fc_bias)
        # fc_input_norm: the target's residual streams are often 10-100x the embeddings' scale; normalizing each
        # part (embeddings, hidden; EAGLE-3: each of the three target states) keeps fc well conditioned.
        self.enorm = RMSNorm(H, cfg.rms_norm_eps) if cfg.fc_input_norm and not self.eagle3 else None
        self.hnorm = RMSNorm((3 if self.eagle3 else 1) * H, cfg.rms_norm_eps) if cfg.fc_input_norm else None
        self.layers = nn.ModuleList([EagleDecoderLayer(cfg, self.rotary_emb)])
        self.embed_tokens = nn.Embedding(self.target_vocab_size, H) if own_embed else None
        self.norm = RMSNorm(H, cfg.rms_norm_eps) if (own_norm and cfg.final_norm) else None
        self.lm_head = nn.Linear(H, self.draft_vocab_size, bias=False) if own_lm_head else None
        if self.draft_vocab_size != self.target_vocab_size and not own_lm_head:
            raise ValueError("EAGLE-3 draft with a reduced vocabulary needs its own lm_head.weight")
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long), persistent=True)
        self._shared: dict[str, Any] = {}

    # -- shared target parts -----------------------------------------------------------------------------------
    def attach_target(self, target: nn.Module) -> None:
        """Borrow the target's embeddings, final norm and lm_head for whatever the checkpoint lacks."""
        from vlserve.models.llama import decoder_of

        dec = decoder_of(target)
        self._shared = {"embed": dec.embed_tokens, "norm": dec.norm, "lm_head": target.lm_head}

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        mod = self.embed_tokens if self.embed_tokens is not None else self._shared["embed"]
        return mod(ids)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft output [N, H] -> logits over the DRAFT vocabulary [N, Vd] float32."""
        if self.cfg.final_norm:
            out = (self.norm if self.norm is not None else self._shared["norm"])(out)
        head = self.lm_head if self.lm_head is not None else self._shared["lm_head"]
        return head(out).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids] if self.eagle3 else draft_ids

    def propose_ids(self, out: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens (target ids) [N] from draft outputs [N, H]."""
        return self.to_target_ids(self.logits(out).argmax(dim=-1))

    # -- the step ----------------------------------------------------------------------------------------------
    def layer_input(self, embeds: torch.Tensor, hidden: torch.Tensor, from_target: bool) -> torch.Tensor:
        """The residual stream entering the layer: EAGLE-1 fc(cat[e; h]); EAGLE-3 fc(aux) for target rows."""
        if self.eagle3:
            if not from_target:
                return hidden
            if self.hnorm is not None:  # each of the three H-wide target states on its own
                H = self.cfg.hidden_size
                parts = hidden.unflatten(-1, (3, H)).float()
                parts = parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + self.hnorm.eps)
                hidden = self.hnorm.weight * parts.flatten(-2).to(hidden.dtype)
            return self.fc(hidden)
        if self.hnorm is not None:
            embeds, hidden = self.enorm(embeds), self.hnorm(hidden)
        return self.fc(torch.cat([embeds, hidden], dim=-1))

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
        from_target: bool,
    ) -> torch.Tensor:
        """Paged step: embeds [T, H] (of token p+1), hidden [T, H or 3H] (target or previous draft output at p),
        positions [T] / [3, T] -> draft output [T, H] (pre-norm; fed back as the next hidden)."""
        layer = self.layers[0]
        x = self.layer_input(embeds, hidden, from_target)
        a = layer.self_attn(positions, layer.attn_input(embeds, x), kv_cache, md)
        return layer.finish(a, x)

    # -- training ----------------------------------------------------------------------------------------------
    def forward_train(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, num_steps: int = 1
    ) -> list[torch.Tensor]:
        """Dense, right-padded batch: embeds [B, L, H] (row p: token p+1), hidden [B, L, H|3H] (target at p),
        positions [B, L] or [B, 3, L]. Returns one [B, L, H] output per unrolled step.

        Step t >= 1 at position p takes step t-1's output at p-1 as its hidden and attends exactly as serving
        does (EAGLE-3's training-time test): to step-0 keys at positions <= p - t and to step i's key at
        position p - t + i for i = 1..t. Outputs at p < t are meaningless (mask them out of the loss).
        """
        B, L, H = embeds.shape
        layer = self.layers[0]
        attn = layer.self_attn
        flat_pos = positions.reshape(-1) if positions.dim() == 2 else positions.permute(1, 0, 2).reshape(3, -1)
        keys, values, outs = [], [], []
        h = hidden
        for t in range(num_steps):
            if t > 0:  # previous step's output at p - 1 becomes the hidden input at p
                h = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], dim=1)
            x = self.layer_input(embeds, h, from_target=(t == 0)).reshape(B * L, H)
            q, k, v = attn.qkv(layer.attn_input(embeds.reshape(B * L, H), x))
            q, k = attn.rope_dense(flat_pos, q, k)
            rep = attn.num_heads // attn.num_kv_heads
            q = q.view(B, L, attn.num_heads, attn.head_dim).transpose(1, 2)  # [B, h, L, D]
            k = k.view(B, L, attn.num_kv_heads, attn.head_dim).repeat_interleave(rep, dim=2).transpose(1, 2)
            v = v.view(B, L, attn.num_kv_heads, attn.head_dim).repeat_interleave(rep, dim=2).transpose(1, 2)
            keys.append(k)
            values.append(v)
            # step-0 keys at positions <= p - t
            s0 = (q @ keys[0].transpose(-1, -2)) * attn.scale  # [B, h, L, L]
            s0 = s0.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=q.device).tril(-t), float("-inf"))
            diag_s, diag_v = [], []
            for i in range(1, t + 1):  # step i's key at position p - (t - i)
                shift = t - i
                ki = (
                    torch.cat(
                        [keys[i].new_zeros(B, attn.num_heads, shift, attn.head_dim), keys[i][:, :, : L - shift]], dim=2
                    )
                    if shift
                    else keys[i]
                )
                vi = (
                    torch.cat(
                        [values[i].new_zeros(B, attn.num_heads, shift, attn.head_dim), values[i][:, :, : L - shift]],
                        dim=2,
                    )
                    if shift
                    else values[i]
                )
                diag_s.append((q * ki).sum(-1, keepdim=True) * attn.scale)  # [B, h, L, 1]
                diag_v.append(vi)
            scores = torch.cat([s0] + diag_s, dim=-1)
            probs = scores.float().softmax(-1).to(q.dtype)
            o = probs[..., :L] @ values[0]
            for i, vi in enumerate(diag_v):
                o = o + probs[..., L + i : L + i + 1] * vi
            o = attn.o_proj(o.transpose(1, 2).reshape(B * L, -1))
            outs.append(layer.finish(o, x).view(B, L, H))
        return outs


__all__ = ["EagleConfig", "EagleDraftModel", "default_eagle3_layer_ids", "ARCHITECTURE", "METHODS"]
