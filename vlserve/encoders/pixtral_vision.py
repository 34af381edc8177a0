"""The Pixtral vision tower (Mistral 3's) on vlserve's kernels: images at their own size and aspect ratio, a patch
conv without bias, an RMSNorm before the transformer, 2-D rotary attention over (row, col) patch positions, each
image attending only to itself, and SiLU-gated MLPs.

`PixtralVisionTower(cfg)(rows [P, C*p*p], grids, feature_layers)` -> `[P, E * len(feature_layers)]`: the patches of
every image of a step (each image's patches row-major, images one after another, cut by the prompt side) go
through in one call, one varlen attention call per layer. Module names follow HF's `PixtralVisionModel` (`patch_conv`,
`ln_pre`, `transformer.layers.N.attention.q_proj`, `...feed_forward.gate_proj`, ...) so weights load by name.
P = patch rows of the step, E = tower width, Hd = E // num_heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vlserve.encoders.vision_layers import AttentionSegments, RMSNorm, VisionRotary
from vlserve.kernels import apply_rotary, build_rotary_cache, varlen_attention
from vlserve.kernels.activation import activation
from vlserve.kernels.packed_linear import PackableLinear, PatchConv2d

PatchGrid = tuple[int, int]  # (rows, cols) of one image, in patches
_NORM_EPS = 1e-5  # Pixtral's norms inside the tower


@dataclass(frozen=True)
class PixtralConfig:
    """The fields of a `PixtralVisionConfig` the tower reads."""

    depth: int
    width: int  # E
    num_heads: int
    mlp_hidden: int
    hidden_act: str
    patch_size: int
    rope_theta: float = 10000.0
    in_channels: int = 3

    def __post_init__(self) -> None:
        if self.width % self.num_heads or (self.width // self.num_heads) % 4:
            raise ValueError(
                f"vision width {self.width} must split into {self.num_heads} heads of a size "
                f"divisible by 4 (2-D rotary)"
            )

    @classmethod
    def from_hf(cls, vision_config) -> PixtralConfig:
        """Read an HF PixtralVisionConfig (`rope_parameters` on 5.x, `rope_theta` on 4.x)."""
        rope = getattr(vision_config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") or getattr(vision_config, "rope_theta", None) or 10000.0
        return cls(
            depth=vision_config.num_hidden_layers,
            width=vision_config.hidden_size,
            num_heads=vision_config.num_attention_heads,
            mlp_hidden=vision_config.intermediate_size,
            hidden_act=vision_config.hidden_act,
            patch_size=int(vision_config.patch_size),
            rope_theta=float(theta),
            in_channels=getattr(vision_config, "num_channels", 3),
        )


def pixtral_rotary(grids: list[PatchGrid], head_dim: int, theta: float, device: torch.device) -> VisionRotary:
    """Rotary tables for every patch: of the Hd/2 frequencies 1/theta**(2i/Hd), the even-indexed ones rotate by the
    patch's row and the odd-indexed ones by its column (as M-RoPE sections (Hd/4, Hd/4, 0) over (row, col, col))."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # [Hd/2]
    inv_2d = torch.cat([inv_freq[0::2], inv_freq[1::2]])  # [Hd/2]: row frequencies, then column ones
    pos = []
    for h, w in grids:
        rows = torch.arange(h).view(h, 1).expand(h, w)
        cols = torch.arange(w).view(1, w).expand(h, w)
        pos.append(torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=-1))  # [h*w, 2]
    positions = torch.cat(pos, dim=0)  # [P, 2]
    cos, sin = build_rotary_cache(inv_2d, max(max(h, w) for h, w in grids))  # [max side, Hd/2]
    pos3 = torch.stack([positions[:, 0], positions[:, 1], positions[:, 1]]).to(device)  # [3, P]
    quarter = head_dim // 4
    return VisionRotary(pos3, cos.to(device), sin.to(device), [quarter, quarter, 0])


class PixtralAttention(nn.Module):
    """q/k/v/o projections without biases, 2-D rotary on q/k, bidirectional attention within each image."""

    def __init__(self, cfg: PixtralConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.width // cfg.num_heads
        self.q_proj = PackableLinear(cfg.width, cfg.width, bias=False)
        self.k_proj = PackableLinear(cfg.width, cfg.width, bias=False)
        self.v_proj = PackableLinear(cfg.width, cfg.width, bias=False)
        self.o_proj = PackableLinear(cfg.width, cfg.width, bias=False)

    def forward(self, x: torch.Tensor, rotary: VisionRotary, segments: AttentionSegments) -> torch.Tensor:
        # x: [P, E] -> [P, E]
        rows = x.shape[0]
        q = self.q_proj(x).view(rows, self.num_heads, self.head_dim)  # [P, Hh, Hd]
        k = self.k_proj(x).view(rows, self.num_heads, self.head_dim)
        v = self.v_proj(x).view(rows, self.num_heads, self.head_dim)
        apply_rotary(q, k, rotary.positions, rotary.cos_cache, rotary.sin_cache, rotary.section)  # in place
        out = varlen_attention(
            q,
            k,
            v,
            segments.cu_seqlens,
            self.head_dim**-0.5,
            max_seqlen=segments.max_len,
            cu_seqlens_cpu=segments.bounds,
        )  # [P, Hh, Hd]
        return self.o_proj(out.reshape(rows, -1))


class PixtralMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), no biases: `[.., E]` -> `[.., E]`."""

    def __init__(self, cfg: PixtralConfig) -> None:
        super().__init__()
        self.gate_proj = PackableLinear(cfg.width, cfg.mlp_hidden, bias=False)
        self.up_proj = PackableLinear(cfg.width, cfg.mlp_hidden, bias=False)
        self.down_proj = PackableLinear(cfg.mlp_hidden, cfg.width, bias=False)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PixtralLayer(nn.Module):
    """Pre-norm block: x + attention(attention_norm(x)), then + feed_forward(ffn_norm(x))."""

    def __init__(self, cfg: PixtralConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.width, eps=_NORM_EPS)
        self.attention = PixtralAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.width, eps=_NORM_EPS)
        self.feed_forward = PixtralMLP(cfg)

    def forward(self, x: torch.Tensor, rotary: VisionRotary, segments: AttentionSegments) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rotary, segments)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nn.Module):
    """`layers.N` as in HF."""

    def __init__(self, cfg: PixtralConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PixtralLayer(cfg) for _ in range(cfg.depth))


class PixtralVisionTower(nn.Module):
    """Pixtral's vision transformer: patch_conv -> ln_pre -> transformer, up to the deepest requested layer."""

    def __init__(self, cfg: PixtralConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_conv = PatchConv2d(cfg.in_channels, cfg.width, cfg.patch_size, bias=False)
        self.ln_pre = RMSNorm(cfg.width, eps=_NORM_EPS)
        self.transformer = PixtralTransformer(cfg)

    def check_rows(self, rows: torch.Tensor, grids: list[PatchGrid]) -> None:
        """ValueError unless `rows` is `[P, C*p*p]` with P the grids' patch count."""
        width = self.cfg.in_channels * self.cfg.patch_size**2
        total = sum(h * w for h, w in grids)
        if rows.dim() != 2 or rows.shape[1] != width or rows.shape[0] != total or min(min(g) for g in grids) <= 0:
            raise ValueError(f"pixel rows must be [{total}, {width}] for patch grids {grids}, got {tuple(rows.shape)}")

    def forward(self, rows: torch.Tensor, grids: list[PatchGrid], feature_layers: list[int]) -> torch.Tensor:
        """`rows [P, C*p*p]` of the images with patch grids `grids`, non-negative hidden-state indices (0 = after
        ln_pre) -> the requested hidden states concatenated `[P, E * len(feature_layers)]`."""
        self.check_rows(rows, grids)
        device = self.patch_conv.param.device
        h = self.ln_pre(self.patch_conv.rows(rows.to(device)))  # [P, E]
        rotary = pixtral_rotary(grids, self.cfg.width // self.cfg.num_heads, self.cfg.rope_theta, device)
        segments = AttentionSegments.from_lengths([gh * gw for gh, gw in grids], device)
        kept = {0: h} if 0 in feature_layers else {}
        for i, layer in enumerate(self.transformer.layers[: max(feature_layers)], start=1):
            h = layer(h, rotary, segments)
            if i in feature_layers:
                kept[i] = h
        return torch.cat([kept[i] for i in feature_layers], dim=-1)  # [P, E * k]
