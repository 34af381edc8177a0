"""Pieces shared by the Qwen2-VL and Qwen2.5-VL vision towers: config, patch embedding, 2-D rotary tables, varlen
attention on vlserve.kernels, norms and the patch merger.

Shapes: P = patch rows of the step (all items concatenated), E = tower width, Hd = E // num_heads,
unit = spatial_merge_size**2 (patches merged into one LLM token), O = merger output width (the LLM hidden size).
Module and parameter names follow the HF checkpoints (`patch_embed.proj.weight`, `blocks.N.attn.qkv.weight`,
`merger.mlp.0.weight`, ...) so weights load by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from vlserve.kernels import apply_rotary_float32, build_rotary_cache, varlen_attention
from vlserve.kernels.activation import activation
from vlserve.kernels.packed_linear import PackableLinear, PatchConv3d
from vlserve.kernels.quick_gelu_cpu import QUICK_GELU_ALPHA
from vlserve.kernels.rms_norm_cpu import rms_norm

Grid = tuple[int, int, int]  # (t, h, w) in patches, as the HF processors' *_grid_thw rows


@dataclass(frozen=True)
class VisionTowerConfig:
    """The vision-tower fields vlserve reads from a checkpoint's `vision_config`."""

    depth: int
    width: int  # E: the tower's hidden size
    num_heads: int
    mlp_hidden: int
    hidden_act: str
    out_dim: int  # O: what the merger projects to (the LLM hidden size)
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 0  # pixels; 0 = no windowed attention (Qwen2-VL)
    fullatt_block_indexes: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.width % self.num_heads or (self.width // self.num_heads) % 4:
            raise ValueError(
                f"vision width {self.width} must split into {self.num_heads} heads of a size "
                f"divisible by 4 (2-D rotary)"
            )


@dataclass
class AttentionSegments:
    """Which rows attend to each other: segment b is rows [bounds[b], bounds[b+1]) (causal: each row sees the rows
    of its segment up to itself)."""

    cu_seqlens: torch.Tensor  # [B+1] int32 on the tower's device
    bounds: list[int]  # the same as Python ints
    max_len: int
    causal: bool = False

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device, causal: bool = False) -> AttentionSegments:
        bounds = [0]
        for n in lengths:
            if n > 0:
                bounds.append(bounds[-1] + n)
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
        return cls(cu_seqlens, bounds, max(lengths, default=0), causal)


@dataclass
class VisionRotary:
    """2-D rotary inputs for every patch row: M-RoPE-style positions (h, w, w) with sections (Hd/4, Hd/4, 0)."""

    positions: torch.Tensor  # [3, P] int64
    cos_cache: torch.Tensor  # [max(h, w), Hd/2] float32
    sin_cache: torch.Tensor
    section: list[int]


def merge_ordered_positions(grids: list[Grid], merge: int) -> torch.Tensor:
    """(row, col) of every patch in the order the processors emit them -> `[P, 2]` int64 (CPU).

    Patches come in merge x merge blocks (the tokens one LLM embedding merges), blocks in row-major order, and the
    whole frame repeats for each of the t temporal patches."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h).view(h, 1).expand(h, w)
        cols = torch.arange(w).view(1, w).expand(h, w)
        frame = torch.stack([rows, cols], dim=-1)  # [h, w, 2]
        frame = frame.view(h // merge, merge, w // merge, merge, 2).permute(0, 2, 1, 3, 4).reshape(-1, 2)
        out.append(frame.repeat(t, 1))
    return torch.cat(out, dim=0)


def build_vision_rotary(
    positions: torch.Tensor, head_dim: int, device: torch.device, theta: float = 10000.0
) -> VisionRotary:
    """Rotary tables for `positions [P, 2]`: the first Hd/4 frequencies rotate by row, the next Hd/4 by column."""
    quarter = head_dim // 4
    inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float32) / (2 * quarter)))  # [Hd/4]
    max_pos = int(positions.max()) + 1 if positions.numel() else 1
    cos, sin = build_rotary_cache(torch.cat([inv_freq, inv_freq]), max_pos)  # [max_pos, Hd/2]
    pos3 = torch.stack([positions[:, 0], positions[:, 1], positions[:, 1]]).to(device)  # [3, P]
    return VisionRotary(pos3, cos.to(device), sin.to(device), [quarter, quarter, 0])


class RMSNorm(nn.Module):
    """RMSNorm with statistics in float32, cast back to the input dtype, then scaled (HF Qwen2RMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = rms_norm(x, self.weight, self.eps)  # one C++ pass over CPU rows; None elsewhere
        if fused is not None:
            return fused
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def make_norm(kind: str, dim: int) -> nn.Module:
    """ "layernorm" (Qwen2-VL) or "rmsnorm" (Qwen2.5-VL), eps 1e-6 like the checkpoints."""
    return nn.LayerNorm(dim, eps=1e-6) if kind == "layernorm" else RMSNorm(dim, eps=1e-6)


class PatchEmbed(nn.Module):
    """Patch rows `[P, C*tp*p*p]` -> `[P, E]`. The weight keeps HF's Conv3d shape `[E, C, tp, p, p]`; a Conv3d
    whose kernel equals its stride over one pre-cut patch is a matmul with the flattened weight, so it runs as one."""

    def __init__(self, cfg: VisionTowerConfig, bias: bool = False) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = PatchConv3d(cfg.in_channels, cfg.width, kernel, bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels)  # [P, C*tp*p*p] -> [P, E]


class VisionAttention(nn.Module):
    """Fused qkv projection, 2-D rotary on q/k (in float32, like HF), bidirectional varlen attention, out proj."""

    def __init__(self, cfg: VisionTowerConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.width // cfg.num_heads
        self.qkv = PackableLinear(cfg.width, 3 * cfg.width, bias=True)
        self.proj = PackableLinear(cfg.width, cfg.width, bias=True)

    def forward(self, x: torch.Tensor, rotary: VisionRotary, segments: AttentionSegments) -> torch.Tensor:
        # x: [P, E] -> [P, E]
        num_rows = x.shape[0]
        q, k, v = self.qkv(x).view(num_rows, 3, self.num_heads, self.head_dim).unbind(1)  # [P, H, Hd] each
        # rotated in place in float32 and rounded back once, as HF's towers do
        apply_rotary_float32(q, k, rotary.positions, rotary.cos_cache, rotary.sin_cache, rotary.section)
        out = varlen_attention(
            q,
            k,
            v,
            segments.cu_seqlens,
            self.head_dim**-0.5,
            max_seqlen=segments.max_len,
            cu_seqlens_cpu=segments.bounds,
        )  # [P, H, Hd]
        return self.proj(out.reshape(num_rows, -1))


class VisionMLP(nn.Module):
    """fc1 -> activation -> fc2 (quick-GELU in Qwen2-VL and CLIP checkpoints, tanh-GELU in SigLIP's); `cfg` is
    any tower config with `width`, `mlp_hidden` and `hidden_act`."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.fc1 = PackableLinear(cfg.width, cfg.mlp_hidden)
        self.fc2 = PackableLinear(cfg.mlp_hidden, cfg.width)
        self.act = activation(cfg.hidden_act)
        self.hidden_act = cfg.hidden_act
        self.quick_gelu_folded = False  # fc1 scaled by QUICK_GELU_ALPHA, fc2 by its inverse (fold_quick_gelu)

    def fold_quick_gelu(self) -> bool:
        """For a quick-GELU MLP with its weights loaded (plain, not yet packed): scale fc1's matrix and bias by
        a = QUICK_GELU_ALPHA and fc2's matrix by 1/a (in float32, rounded once to their dtype), so that
        fc2(silu(fc1(x))) now equals the checkpoint's fc2(quick_gelu(fc1(x))) (silu(a t) / a = t * sigmoid(a t))
        and the activation runs inside fc1's matmul (`PackableLinear.matmul_silu`). Whether it folded (not for
        other activations, nor twice). The parameters no longer equal the checkpoint's: not for modules whose
        linears others wrap (tower LoRA)."""
        if self.hidden_act != "quick_gelu" or self.quick_gelu_folded:
            return False
        if self.fc1.weight is None or self.fc2.weight is None:
            raise ValueError("fold_quick_gelu needs the plain weights: fold before packing the linears")
        for param, scale in ((self.fc1.weight, QUICK_GELU_ALPHA), (self.fc1.bias, QUICK_GELU_ALPHA)):
            param.data.copy_(param.data.float() * scale)
        self.fc2.weight.data.copy_(self.fc2.weight.data.float() / QUICK_GELU_ALPHA)
        self.quick_gelu_folded = True
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [.., E] -> [.., E]
        if self.quick_gelu_folded:
            return self.fc2(self.fc1.matmul_silu(x))
        return self.fc2(self.act(self.fc1(x)))


def fold_quick_gelu_mlps(module: nn.Module) -> int:
    """`VisionMLP.fold_quick_gelu` on every MLP under `module` (loaded, not yet packed); how many folded."""
    return sum(m.fold_quick_gelu() for m in module.modules() if isinstance(m, VisionMLP))


class PatchMerger(nn.Module):
    """Norm each patch, concatenate each merge x merge block, then a 2-layer GELU MLP: `[P, E]` -> `[P/unit, O]`."""

    def __init__(self, cfg: VisionTowerConfig, norm: str) -> None:
        super().__init__()
        self.merged_width = cfg.width * cfg.spatial_merge_size**2
        self.ln_q = make_norm(norm, cfg.width)
        self.mlp = nn.Sequential(
            PackableLinear(self.merged_width, self.merged_width),
            nn.GELU(),
            PackableLinear(self.merged_width, cfg.out_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_width))


def frame_lengths(grids: list[Grid]) -> list[int]:
    """Patch rows per frame: each temporal patch of an item attends only within itself (as HF's towers do)."""
    return [h * w for t, h, w in grids for _ in range(t)]


def check_grids(grids: list[Grid], pixels: torch.Tensor, cfg: VisionTowerConfig) -> None:
    """ValueError unless pixel rows and grids agree and every grid side is a multiple of spatial_merge_size."""
    merge = cfg.spatial_merge_size
    row_width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    if pixels.dim() != 2 or pixels.shape[1] != row_width:
        raise ValueError(f"pixel rows must be [P, {row_width}], got {tuple(pixels.shape)}")
    for t, h, w in grids:
        if min(t, h, w) <= 0 or h % merge or w % merge:
            raise ValueError(f"grid (t={t}, h={h}, w={w}) must be positive with h and w multiples of {merge}")
    total = sum(t * h * w for t, h, w in grids)
    if total != pixels.shape[0]:
        raise ValueError(f"grids cover {total} patches but {pixels.shape[0]} pixel rows were given")


class VisionBlock(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then + mlp(norm2(x)); LayerNorms for Qwen2-VL, RMSNorms for Qwen2.5-VL."""

    def __init__(self, cfg: VisionTowerConfig, norm_kind: str, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1 = make_norm(norm_kind, cfg.width)
        self.norm2 = make_norm(norm_kind, cfg.width)
        self.attn = VisionAttention(cfg)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rotary: VisionRotary, segments: AttentionSegments) -> torch.Tensor:
        # x: [P, E] -> [P, E]
        x = x + self.attn(self.norm1(x), rotary, segments)
        return x + self.mlp(self.norm2(x))
