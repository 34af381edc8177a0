"""CLIP and SigLIP vision towers with their pooled output (HF's `pooler_output`), as the dual-tower embedders read
them: one `[N, E]` vector per image.

`ClipPooledVisionTower(cfg).pooled(pixels [N, C, S, S])` -> `[N, E]`: post_layernorm of the class token's last
hidden state. `SiglipPooledVisionTower(cfg).pooled(pixels)` -> `[N, E]`: the multihead-attention pooling head
(`head.probe`, `head.attention`, `head.layernorm`, `head.mlp`) over the post_layernorm'd last hidden state.
Both reuse the LLaVA / Gemma towers (clip_vision.py, siglip_vision.py) and load the same HF names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlserve.encoders.clip_vision import ClipVisionTower, VitConfig
from vlserve.encoders.siglip_vision import SiglipVisionTower
from vlserve.encoders.vision_layers import VisionMLP


class ClipPooledVisionTower(ClipVisionTower):
    """CLIP's vision transformer with its class-token pooling (q/k/v in one fused linear per layer)."""

    fuses_qkv = True

    def pooled(self, pixels: torch.Tensor) -> torch.Tensor:
        """`pixels [N, C, S, S]` -> post_layernorm(last hidden state of the class token) `[N, E]` (the last layer
        computes the class tokens' rows alone past its attention)."""
        x = self.encoder_input(pixels)  # [N, L, E]
        return self.post_layernorm(self.encoder.first_token_states(x, self.tokens_per_tile))


class AttentionPoolingHead(nn.Module):
    """SigLIP's pooling: a learned probe attends over all patches (torch's MultiheadAttention, whose parameter names
    the checkpoints use), then x + mlp(layernorm(x))."""

    def __init__(self, cfg: VitConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.probe = nn.Parameter(torch.zeros(1, 1, cfg.width))
        self.attention = nn.MultiheadAttention(cfg.width, cfg.num_heads, batch_first=True)
        self.layernorm = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, L, E] -> [N, E]
        num_images, num_tokens, width = hidden.shape
        head_dim = width // self.num_heads
        w_q, w_k, w_v = self.attention.in_proj_weight.chunk(3)  # [E, E] each
        b_q, b_k, b_v = self.attention.in_proj_bias.chunk(3)
        q = F.linear(self.probe.view(1, width), w_q, b_q)  # [1, E]: the probe is the same for every image
        q = q.view(1, self.num_heads, 1, head_dim).expand(num_images, -1, -1, -1)  # [N, H, 1, Hd]
        k = F.linear(hidden, w_k, b_k).view(num_images, num_tokens, self.num_heads, head_dim).transpose(1, 2)
        v = F.linear(hidden, w_v, b_v).view(num_images, num_tokens, self.num_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)  # [N, H, 1, Hd]
        out = self.attention.out_proj(out.reshape(num_images, width))  # [N, E]
        return out + self.mlp(self.layernorm(out))


class SiglipPooledVisionTower(SiglipVisionTower):
    """SigLIP's vision transformer with its attention-pooling head (loaded, not skipped; q/k/v in one fused linear
    per layer)."""

    ignored_prefixes = ()
    fuses_qkv = True

    def __init__(self, cfg: VitConfig) -> None:
        super().__init__(cfg)
        self.head = AttentionPoolingHead(cfg)

    def pooled(self, pixels: torch.Tensor) -> torch.Tensor:
        """`pixels [N, C, S, S]` -> the pooling head's output `[N, E]`."""
        return self.head(self.last_hidden_state(pixels))
