"""Gemma 3's text decoder (`Gemma3ForCausalLM`) as seams on the Llama decoder (vlserve.models.llama).

What Gemma 3 changes: token embeddings scaled by sqrt(H) (the scale rounded to the model dtype, as HF does);
RMSNorm as `norm(x) * (1 + weight)` all in float32, cast back at the end; four norms per block, the attention and
MLP outputs normed before their residual adds; per-head q/k norms before RoPE; attention scale
`query_pre_attn_scalar ** -0.5`; a GeGLU MLP (`hidden_activation`); sliding-window layers by `layer_types`
(`hf_config.sliding_window_of`: HF's window W means a query at p sees keys p - W + 1 .. p, our convention); and a
RoPE table per layer type (`hf_config.layer_type_rope_params_of`): full layers `rope_theta` with their scaling,
sliding ones default RoPE at the local base frequency. `final_logit_softcapping` is applied to the logits;
`attn_logit_softcapping` and bidirectional attention are refused. Weight names are HF's (`model.*`; lm_head is
tied to the embeddings by default).

Tokens are flattened as in llama.py: `T` tokens, `H` hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from vlserve.models.capabilities import DECODER_LORA_TARGETS, ModelCapabilities
from vlserve.models.causal_lm import LlamaForCausalLM
from vlserve.models.hf_config import layer_type_rope_params_of
from vlserve.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from vlserve.models.llama import DecoderAttention, LlamaDecoderModel
from vlserve.models.parallel_layers import VocabParallelEmbedding

LAYER_TYPES = ("full_attention", "sliding_attention")  # HF fills `layer_types` (4.57 and 5.x alike)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: `(x_normed * (1 + weight))` in float32, then cast to the input dtype (weight starts at 0).

    Same interface as RMSNorm, fused residual add included (the sum is taken in the input dtype)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def _fused(self, x: torch.Tensor, residual: torch.Tensor | None):
        return None  # the C++ kernel computes RMSNorm's arithmetic, not this one

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., H] -> [..., H] (x's dtype); statistics, scale and (1 + weight) all in float32
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.to(torch.float32))).to(x.dtype)


class ScaledEmbedding(VocabParallelEmbedding):
    """Token embedding times sqrt(hidden_size), the scale rounded to the weight's dtype first (HF: bf16 makes
    sqrt(3072) 55.5)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.scale = float(hidden_size) ** 0.5
        self.init_buffers()

    def init_buffers(self, device=None) -> None:
        """Round the scale to the weight's dtype (again after the loader materializes the weights)."""
        self.rounded_scale = float(torch.tensor(self.scale, dtype=self.weight.dtype, device="cpu"))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, H]
        return super().forward(input_ids) * self.rounded_scale


class LayerTypeRotary(nn.ModuleDict):
    """One RotaryEmbedding per layer type of the config (shared by the layers of that type)."""

    def __init__(self, config) -> None:
        super().__init__(
            {
                t: RotaryEmbedding(config, params=layer_type_rope_params_of(config, t))
                for t in sorted(set(config.layer_types))
            }
        )


class Gemma3Attention(DecoderAttention):
    """DecoderAttention with Gemma's q/k norms and scale `query_pre_attn_scalar ** -0.5`; the window comes from
    `sliding_window_of` (set by DecoderAttention)."""

    def __init__(self, config, rotary: RotaryEmbedding, layer_idx: int) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, rotary, bias, bias, qk_norm=False, layer_idx=layer_idx)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5


class Gemma3DecoderLayer(nn.Module):
    """Gemma 3 block: `h = x + post_attn_norm(attn(input_norm(x))); out = h + post_ff_norm(mlp(pre_ff_norm(h)))`.

    Takes DecoderLayer's constructor arguments (the biases and q/k-norm flags are fixed by Gemma, an MLP factory
    is not supported) and `rotary`, the decoder's LayerTypeRotary, from which it takes its layer type's table."""

    def __init__(
        self,
        config,
        rotary: LayerTypeRotary,
        qkv_bias=None,
        o_bias=None,
        qk_norm=None,
        layer_idx: int = 0,
        mlp_factory=None,
    ) -> None:
        super().__init__()
        if mlp_factory is not None:
            raise ValueError("Gemma 3 layers take no MLP factory")
        self.self_attn = Gemma3Attention(config, rotary[config.layer_types[layer_idx]], layer_idx)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "gelu_pytorch_tanh"
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, act)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, kv_cache, attn_metadata
    ):
        """`(hidden [T,H], residual [T,H] | None) -> (normed mlp_out [T,H], residual [T,H])`, as DecoderLayer."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, attn_metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3TextDecoderModel(LlamaDecoderModel):
    """Gemma 3's text decoder: LlamaDecoderModel with the scaled embedding, Gemma blocks, Gemma's final norm and a
    RoPE table per layer type (`rotary_emb.full_attention`, `rotary_emb.sliding_attention`)."""

    embedding_cls, layer_cls, norm_cls, rotary_cls = ScaledEmbedding, Gemma3DecoderLayer, GemmaRMSNorm, LayerTypeRotary

    def __init__(self, config, **kwargs) -> None:
        check_gemma3_text_config(config)
        super().__init__(config, **kwargs)


def check_gemma3_text_config(config) -> None:
    """ValueError for Gemma 3 settings vlserve does not implement (attention logit soft-capping, bidirectional
    attention) or layer types it does not know."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"Gemma 3 attn_logit_softcapping={config.attn_logit_softcapping} is not supported "
            "(the attention kernels do not soft-cap scores)"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("Gemma 3 with use_bidirectional_attention=True (embedding models) is not supported")
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != config.num_hidden_layers or not set(types) <= set(LAYER_TYPES):
        raise ValueError(
            f"Gemma 3 layer_types must give one of {LAYER_TYPES} per layer "
            f"({config.num_hidden_layers} layers), got {types}"
        )


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text-only causal LM: `model` (Gemma3TextDecoderModel) + `lm_head`, logits soft-capped by
    `final_logit_softcapping` when the config sets it."""

    decoder_cls = Gemma3TextDecoderModel
    # not tried over pipeline stages yet
    capabilities = ModelCapabilities(tensor_parallel=True, lora_targets=DECODER_LORA_TARGETS)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden [N, H]` -> logits `[N, V]` float32; `cap * tanh(logits / cap)` in the model dtype, as HF."""
        logits = self.lm_head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
