"""The InternViT vision tower of InternVL (HF `InternVLVisionModel`) on vlserve's kernels.

`InternVitTower(cfg)(pixels [N, C, S, S], feature_layer)` -> `[N, L, E]` with L = (S / patch)**2 + 1 (class token
first): the hidden state of one layer. Every tile of a step goes through in one call; each tile attends only to its
own tokens (one varlen attention call per layer). Blocks are pre-norm with learned per-channel layer scales
(`lambda_1`, `lambda_2`), LayerNorm or RMSNorm as configured, and optional RMSNorm over the whole q / k projections.
Module names follow the 5.x checkpoints (`embeddings.patch_embeddings.projection`, `encoder.layer.N.attention.q_proj`,
`encoder.layer.N.lambda_1`, ...) so weights load by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vlserve.encoders.clip_vision import VitConfig, feature_layer_indices
from vlserve.encoders.vision_layers import AttentionSegments, RMSNorm, VisionMLP
from vlserve.kernels import varlen_attention
from vlserve.kernels.packed_linear import PackableLinear, PatchConv2d


def _side(value) -> int:
    """A square side from an int or a (height, width) pair; ValueError for non-square ones."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"InternViT needs square images and patches, got {tuple(value)}")
        return int(value[0])
    return int(value)


@dataclass(frozen=True)
class InternVitConfig(VitConfig):
    """The CLIP-style tower fields plus what an HF `InternVLVisionConfig` adds."""

    norm_type: str = "layer_norm"  # or "rms_norm"
    qk_norm: bool = False
    qkv_bias: bool = False
    use_mean_pooling: bool = True  # False: a final LayerNorm on the last hidden state
    absolute_positions: bool = True

    @classmethod
    def from_hf(cls, vc) -> InternVitConfig:
        """Read an HF InternVLVisionConfig; ValueError for a norm type we do not build."""
        norm_type = getattr(vc, "norm_type", "layer_norm")
        if norm_type not in ("layer_norm", "rms_norm"):
            raise ValueError(f"InternViT norm_type must be 'layer_norm' or 'rms_norm', got {str(norm_type)[:40]!r}")
        return cls(
            depth=vc.num_hidden_layers,
            width=vc.hidden_size,
            num_heads=vc.num_attention_heads,
            mlp_hidden=vc.intermediate_size,
            hidden_act=vc.hidden_act,
            image_size=_side(vc.image_size),
            patch_size=_side(vc.patch_size),
            layer_norm_eps=vc.layer_norm_eps,
            norm_type=norm_type,
            qk_norm=bool(getattr(vc, "use_qk_norm", False)),
            qkv_bias=bool(getattr(vc, "attention_bias", False)),
            use_mean_pooling=bool(getattr(vc, "use_mean_pooling", True)),
            absolute_positions=bool(getattr(vc, "use_absolute_position_embeddings", True)),
            in_channels=getattr(vc, "num_channels", 3),
        )

    @property
    def grid(self) -> int:
        """Patches per tile side."""
        return self.image_size // self.patch_size

    def norm(self) -> nn.Module:
        """One block norm of the configured kind."""
        if self.norm_type == "rms_norm":
            return RMSNorm(self.width, eps=self.layer_norm_eps)
        return nn.LayerNorm(self.width, eps=self.layer_norm_eps)


class InternVitAttention(nn.Module):
    """q/k/v projections (biases as configured), optional RMSNorm over the full q and k widths, bidirectional
    varlen attention per tile, `projection_layer` out."""

    def __init__(self, cfg: InternVitConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.width // cfg.num_heads
        self.q_proj = PackableLinear(cfg.width, cfg.width, bias=cfg.qkv_bias)
        self.k_proj = PackableLinear(cfg.width, cfg.width, bias=cfg.qkv_bias)
        self.v_proj = PackableLinear(cfg.width, cfg.width, bias=cfg.qkv_bias)
        self.projection_layer = PackableLinear(cfg.width, cfg.width)
        self.q_norm = RMSNorm(cfg.width) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.width) if cfg.qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, segments: AttentionSegments) -> torch.Tensor:
        # x: [R, E] (rows of all tiles) -> [R, E]
        rows = x.shape[0]
        q = self.q_norm(self.q_proj(x)).view(rows, self.num_heads, self.head_dim)  # [R, H, Hd]
        k = self.k_norm(self.k_proj(x)).view(rows, self.num_heads, self.head_dim)
        v = self.v_proj(x).view(rows, self.num_heads, self.head_dim)
        out = varlen_attention(
            q.contiguous(),
            k.contiguous(),
            v,
            segments.cu_seqlens,
            self.head_dim**-0.5,
            max_seqlen=segments.max_len,
            cu_seqlens_cpu=segments.bounds,
        )  # [R, H, Hd]
        return self.projection_layer(out.reshape(rows, -1))


class InternVitLayer(nn.Module):
    """x + lambda_1 * attn(norm_before(x)), then + lambda_2 * mlp(norm_after(x))."""

    def __init__(self, cfg: InternVitConfig) -> None:
        super().__init__()
        self.attention = InternVitAttention(cfg)
        self.mlp = VisionMLP(cfg)
        self.layernorm_before = cfg.norm()
        self.layernorm_after = cfg.norm()
        self.lambda_1 = nn.Parameter(torch.ones(cfg.width))
        self.lambda_2 = nn.Parameter(torch.ones(cfg.width))

    def forward(self, x: torch.Tensor, segments: AttentionSegments) -> torch.Tensor:
        # x: [R, E] -> [R, E]
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x), segments)
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class InternVitEncoder(nn.Module):
    """`layer.N` as in HF."""

    def __init__(self, cfg: InternVitConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(InternVitLayer(cfg) for _ in range(cfg.depth))


class PatchEmbeddings(nn.Module):
    """`projection`: the patch conv (with bias) run as one GEMM."""

    def __init__(self, cfg: InternVitConfig) -> None:
        super().__init__()
        self.projection = PatchConv2d(cfg.in_channels, cfg.width, cfg.patch_size, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.projection(pixels)  # [N, C, S, S] -> [N, np, E]


class InternVitEmbeddings(nn.Module):
    """Class token + patch embeddings + learned absolute positions (at the trained size: no interpolation)."""

    def __init__(self, cfg: InternVitConfig) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.width))
        self.patch_embeddings = PatchEmbeddings(cfg)
        self.position_embeddings = (
            nn.Parameter(torch.zeros(1, cfg.grid**2 + 1, cfg.width)) if cfg.absolute_positions else None
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # pixels: [N, C, S, S] -> [N, 1 + np, E]
        patches = self.patch_embeddings(pixels)  # [N, np, E]
        x = torch.cat([self.cls_token.to(patches.dtype).expand(patches.shape[0], 1, -1), patches], dim=1)
        return x if self.position_embeddings is None else x + self.position_embeddings


class InternVitTower(nn.Module):
    """InternViT up to a chosen layer: `embeddings`, `encoder.layer.N`, and `layernorm` when the config has no mean
    pooling (applied to the last layer's output only, as HF does)."""

    def __init__(self, cfg: InternVitConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = InternVitEmbeddings(cfg)
        self.encoder = InternVitEncoder(cfg)
        self.layernorm = nn.Identity() if cfg.use_mean_pooling else nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)

    @property
    def tokens_per_tile(self) -> int:
        return self.cfg.grid**2 + 1

    def check_pixels(self, pixels: torch.Tensor) -> None:
        """ValueError unless `pixels` is `[N, C, S, S]` at the tower's image size."""
        s = self.cfg.image_size
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (self.cfg.in_channels, s, s):
            raise ValueError(f"pixel_values must be [N, {self.cfg.in_channels}, {s}, {s}], got {tuple(pixels.shape)}")

    def forward(self, pixels: torch.Tensor, feature_layer: int = -1) -> torch.Tensor:
        """`pixels [N, C, S, S]` -> hidden state `[N, L, E]` of `feature_layer` (HF's `vision_feature_layer`: -1 is
        the final output, other values index the depth + 1 hidden states, 0 = the embeddings)."""
        self.check_pixels(pixels)
        last = feature_layer == -1
        depth = self.cfg.depth if last else feature_layer_indices(feature_layer, self.cfg.depth)[0]
        dtype = self.embeddings.cls_token.dtype
        x = self.embeddings(pixels.to(self.embeddings.cls_token.device, dtype))  # [N, L, E]
        num_tiles, length = x.shape[:2]
        segments = AttentionSegments.from_lengths([length] * num_tiles, x.device)
        h = x.reshape(num_tiles * length, -1)  # [R, E]
        for layer in self.encoder.layer[:depth]:
            h = layer(h, segments)
        if last:
            h = self.layernorm(h)
        return h.view(num_tiles, length, -1)
