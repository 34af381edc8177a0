"""The SigLIP vision tower on vlserve's kernels, as LLaVA uses it: no class token, patch conv with a bias, learned
positions, the shared ViT encoder (clip_vision.py), post_layernorm loaded but unused for hidden-state features.

`SiglipVisionTower(cfg)(pixels [N, C, S, S], feature_layers)` -> `[N, (S / patch)**2, E * len(feature_layers)]`;
`last_hidden_state(pixels)` -> `[N, (S / patch)**2, E]`, the last layer's output through post_layernorm (HF's
`SiglipVisionModel(...).last_hidden_state`, what Gemma 3 reads).
The attention-pooling `head.*` weights of checkpoints that have one are skipped: LLaVA reads hidden states only.
"""

from __future__ import annotations

import torch
from torch import nn

from vlserve.encoders.clip_vision import ClipVisionTower, VitConfig, VitEncoder
from vlserve.kernels.packed_linear import PatchConv2d


class SiglipEmbeddings(nn.Module):
    """Patch conv (with bias) + learned absolute positions."""

    def __init__(self, cfg: VitConfig) -> None:
        super().__init__()
        self.patch_embedding = PatchConv2d(cfg.in_channels, cfg.width, cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.num_patches, cfg.width)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # pixels: [N, C, S, S] -> [N, (S/p)**2, E]
        patches = self.patch_embedding(pixels)  # [N, np, E]
        return patches + self.position_embedding.weight


class SiglipVisionTower(ClipVisionTower):
    """SigLIP's vision transformer up to the requested layers (weight loading shared with CLIP)."""

    ignored_prefixes = ("head.",)

    def __init__(self, cfg: VitConfig) -> None:
        nn.Module.__init__(self)
        self.cfg = cfg
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = VitEncoder(cfg, self.fuses_qkv)
        self.post_layernorm = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)

    @property
    def tokens_per_tile(self) -> int:
        return self.cfg.num_patches

    def forward(self, pixels: torch.Tensor, feature_layers: list[int]) -> torch.Tensor:
        """`pixels [N, C, S, S]`, non-negative hidden-state indices -> `[N, L, E * len(feature_layers)]`."""
        self.check_pixels(pixels)
        x = self.embeddings(pixels.to(self.embeddings.patch_embedding.param.device))
        return self.encoder(x, self.tokens_per_tile, feature_layers)

    def last_hidden_state(self, pixels: torch.Tensor) -> torch.Tensor:
        """`pixels [N, C, S, S]` -> the last layer's output after post_layernorm `[N, (S/p)**2, E]`."""
        return self.post_layernorm(self(pixels, [self.cfg.depth]))
