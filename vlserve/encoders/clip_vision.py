"""The CLIP vision tower (ViT with a class token) on vlserve's kernels, as LLaVA uses it: hidden states of chosen
layers, not the pooled output.

`ClipVisionTower(cfg)(pixels [N, C, S, S], feature_layers)` -> `[N, L, E * len(feature_layers)]` with
L = (S / patch)**2 + 1 (class token first). Every tile of a step goes through in one call; each tile attends only
to its own tokens (one varlen attention call per layer). Module names follow HF's `CLIPVisionModel`
(`embeddings.patch_embedding`, `pre_layrnorm`, `encoder.layers.N.self_attn.q_proj`, ...) so weights load by name.
The pieces here (config, encoder layer, weight loading) are shared with the SigLIP tower.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from vlserve.encoders.vision_layers import AttentionSegments, VisionMLP
from vlserve.kernels import varlen_attention
from vlserve.kernels.packed_linear import PackableLinear, PatchConv2d

# Checkpoint names that carry nothing we compute with (buffers saved by some versions).
_IGNORED_SUFFIXES = ("position_ids",)


@dataclass(frozen=True)
class VitConfig:
    """The fields of a CLIP / SigLIP `vision_config` the towers read."""

    depth: int
    width: int  # E
    num_heads: int
    mlp_hidden: int
    hidden_act: str
    image_size: int
    patch_size: int
    layer_norm_eps: float
    in_channels: int = 3

    @classmethod
    def from_hf(cls, vision_config) -> VitConfig:
        """Read an HF CLIPVisionConfig / SiglipVisionConfig."""
        return cls(
            depth=vision_config.num_hidden_layers,
            width=vision_config.hidden_size,
            num_heads=vision_config.num_attention_heads,
            mlp_hidden=vision_config.intermediate_size,
            hidden_act=vision_config.hidden_act,
            image_size=vision_config.image_size,
            patch_size=vision_config.patch_size,
            layer_norm_eps=vision_config.layer_norm_eps,
            in_channels=getattr(vision_config, "num_channels", 3),
        )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def feature_layer_indices(feature_layers: int | list[int], depth: int) -> list[int]:
    """HF `vision_feature_layer` (int or list; negative counts from the end of the depth + 1 hidden states,
    index 0 = the encoder's input) -> non-negative indices; ValueError when one is out of range."""
    layers = [feature_layers] if isinstance(feature_layers, int) else list(feature_layers)
    out = []
    for layer in layers:
        idx = layer + depth + 1 if layer < 0 else layer
        if not 0 <= idx <= depth:
            raise ValueError(f"vision_feature_layer {layer} is out of range for a tower of {depth} layers")
        out.append(idx)
    return out


class VitAttention(nn.Module):
    """q/k/v projections with biases, varlen attention per segment (a tile: bidirectional), out projection. The
    projections are three linears as the checkpoints name them (`q_proj`, `k_proj`, `v_proj`), or with `fused_qkv` one
    `qkv_proj` [E -> 3E] that `copy_tower_weights` fills from those three (one matmul instead of three; no tower LoRA
    then)."""

    def __init__(self, cfg: VitConfig, fused_qkv: bool = False) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.width // cfg.num_heads
        self.fused_qkv = fused_qkv
        if fused_qkv:
            self.qkv_proj = PackableLinear(cfg.width, 3 * cfg.width)
        else:
            self.q_proj = PackableLinear(cfg.width, cfg.width)
            self.k_proj = PackableLinear(cfg.width, cfg.width)
            self.v_proj = PackableLinear(cfg.width, cfg.width)
        self.out_proj = PackableLinear(cfg.width, cfg.width)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`x [R, E]` -> (q, k, v), each `[R, E]` (with `fused_qkv`: column slices of one `[R, 3E]` product)."""
        if self.fused_qkv:
            return self.qkv_proj(x).chunk(3, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, segments: AttentionSegments, keep: torch.Tensor | None = None) -> torch.Tensor:
        # x: [R, E] (rows of all tiles) -> [R, E], or [K, E]: the rows `keep [K]` alone through out_proj
        rows = x.shape[0]
        q, k, v = (t.view(rows, self.num_heads, self.head_dim) for t in self.project_qkv(x))  # [R, H, Hd] each
        out = varlen_attention(
            q,
            k,
            v,
            segments.cu_seqlens,
            self.head_dim**-0.5,
            max_seqlen=segments.max_len,
            cu_seqlens_cpu=segments.bounds,
            causal=segments.causal,
        )  # [R, H, Hd]
        out = out.reshape(rows, -1)
        return self.out_proj(out if keep is None else out.index_select(0, keep))


class VitEncoderLayer(nn.Module):
    """Pre-norm block: x + attn(layer_norm1(x)), then + mlp(layer_norm2(x))."""

    def __init__(self, cfg: VitConfig, fused_qkv: bool = False) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.self_attn = VitAttention(cfg, fused_qkv)
        self.layer_norm2 = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, segments: AttentionSegments, keep: torch.Tensor | None = None) -> torch.Tensor:
        """`x [R, E]` -> `[R, E]`, or with `keep [K]` (increasing row indices) the block output at those rows alone
        `[K, E]` (attention still reads every row)."""
        attended = self.self_attn(self.layer_norm1(x), segments, keep)
        x = (x if keep is None else x.index_select(0, keep)) + attended
        return x + self.mlp(self.layer_norm2(x))


class VitEncoder(nn.Module):
    """`layers.N` as in HF; runs only as deep as the deepest requested hidden state."""

    def __init__(self, cfg: VitConfig, fused_qkv: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VitEncoderLayer(cfg, fused_qkv) for _ in range(cfg.depth))

    def forward(self, x: torch.Tensor, tokens_per_tile: int, feature_layers: list[int]) -> torch.Tensor:
        """`x [N, L, E]` (the encoder's input) -> the requested hidden states concatenated: `[N, L, E * k]`."""
        num_tiles = x.shape[0]
        segments = AttentionSegments.from_lengths([tokens_per_tile] * num_tiles, x.device)
        h = x.reshape(num_tiles * tokens_per_tile, -1)  # [R, E]
        kept = {0: h} if 0 in feature_layers else {}
        for i, layer in enumerate(self.layers[: max(feature_layers)], start=1):
            h = layer(h, segments)
            if i in feature_layers:
                kept[i] = h
        out = torch.cat([kept[i] for i in feature_layers], dim=-1)  # [R, E * k]
        return out.view(num_tiles, tokens_per_tile, -1)

    def first_token_states(self, x: torch.Tensor, tokens_per_tile: int) -> torch.Tensor:
        """`x [N, L, E]` (the encoder's input) -> the last layer's output at each tile's first token `[N, E]`; that
        layer runs its out_proj and MLP on those rows alone."""
        num_tiles = x.shape[0]
        segments = AttentionSegments.from_lengths([tokens_per_tile] * num_tiles, x.device)
        h = x.reshape(num_tiles * tokens_per_tile, -1)  # [R, E]
        for layer in self.layers[:-1]:
            h = layer(h, segments)
        first = torch.arange(num_tiles, device=h.device) * tokens_per_tile  # [N]
        return self.layers[-1](h, segments, first)  # [N, E]


class ClipEmbeddings(nn.Module):
    """Patch conv (no bias) + a learned class token + learned absolute positions."""

    def __init__(self, cfg: VitConfig) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.zeros(cfg.width))
        self.patch_embedding = PatchConv2d(cfg.in_channels, cfg.width, cfg.patch_size, bias=False)
        self.position_embedding = nn.Embedding(cfg.num_patches + 1, cfg.width)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # pixels: [N, C, S, S] -> [N, 1 + (S/p)**2, E]
        patches = self.patch_embedding(pixels)  # [N, np, E]
        cls = self.class_embedding.view(1, 1, -1).expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight  # [N, 1 + np, E]


class ClipVisionTower(nn.Module):
    """CLIP's vision transformer up to the requested layers (post_layernorm is loaded but LLaVA never reads it)."""

    ignored_prefixes: tuple[str, ...] = ()
    fuses_qkv = False  # one qkv_proj per layer (VitAttention's fused_qkv); towers open to tower LoRA keep three

    def __init__(self, cfg: VitConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = ClipEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.encoder = VitEncoder(cfg, self.fuses_qkv)
        self.post_layernorm = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)

    @property
    def tokens_per_tile(self) -> int:
        return self.cfg.num_patches + 1

    def check_pixels(self, pixels: torch.Tensor) -> None:
        """ValueError unless `pixels` is `[N, C, S, S]` at the tower's image size."""
        s = self.cfg.image_size
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (self.cfg.in_channels, s, s):
            raise ValueError(f"pixel_values must be [N, {self.cfg.in_channels}, {s}, {s}], got {tuple(pixels.shape)}")

    def forward(self, pixels: torch.Tensor, feature_layers: list[int]) -> torch.Tensor:
        """`pixels [N, C, S, S]`, non-negative hidden-state indices -> `[N, L, E * len(feature_layers)]`."""
        return self.encoder(self.encoder_input(pixels), self.tokens_per_tile, feature_layers)

    def encoder_input(self, pixels: torch.Tensor) -> torch.Tensor:
        """`pixels [N, C, S, S]` (checked) -> the encoder's input `[N, L, E]`: embeddings after pre_layrnorm."""
        self.check_pixels(pixels)
        return self.pre_layrnorm(self.embeddings(pixels.to(self.embeddings.patch_embedding.param.device)))

    def expected_weight_names(self) -> set[str]:
        """The names `load_weights` reports for a whole checkpoint, relative to the tower (`tower_weight_names`)."""
        return tower_weight_names(self)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors (relative to the tower, with or without `vision_model.`) into the parameters;
        returns the parameter names filled. ValueError on an unknown name or a shape mismatch."""
        return copy_tower_weights(self, weights, "vision_model.", "vision tower", self.ignored_prefixes)


_QKV_PIECES = {"q_proj": 0, "k_proj": 1, "v_proj": 2}


def _fused_qkv_piece(rel: str, params: dict[str, torch.Tensor]) -> tuple[str, int] | None:
    """`...self_attn.{q,k,v}_proj.{weight,bias}` -> (the name of the fused `...self_attn.qkv_proj.*` parameter that
    holds it, its third: 0 / 1 / 2), where the tower has one; None otherwise."""
    head, _, leaf = rel.rpartition(".")
    block, _, proj = head.rpartition(".")
    name = f"{block}.qkv_proj.{leaf}"
    return (name, _QKV_PIECES[proj]) if proj in _QKV_PIECES and name in params else None


def tower_weight_names(tower: nn.Module) -> set[str]:
    """The names `copy_tower_weights` reports for a whole checkpoint: the parameters', a fused `qkv_proj.*` standing
    as the three checkpoint names it is filled from (`q_proj.*`, `k_proj.*`, `v_proj.*`)."""
    names: set[str] = set()
    for name, _ in tower.named_parameters():
        block, fused, leaf = name.rpartition(".qkv_proj.")
        names |= {f"{block}.{proj}.{leaf}" for proj in _QKV_PIECES} if fused else {name}
    return names


@torch.no_grad()
def copy_tower_weights(
    tower: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    prefix: str,
    kind: str,
    ignored_prefixes: tuple[str, ...] = (),
) -> set[str]:
    """Copy HF-named tensors (relative to `tower`, with or without `prefix`) into its parameters, skipping saved
    buffers and `ignored_prefixes`; q/k/v projections go into their third of a fused `qkv_proj` where the tower has
    one. Returns the names filled, relative to the tower (a third by its checkpoint name: `tower_weight_names`).
    ValueError on an unknown name or a shape mismatch (`kind` names the tower in the message)."""
    params = dict(tower.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        rel = name[len(prefix) :] if name.startswith(prefix) else name
        if rel.endswith(_IGNORED_SUFFIXES) or rel.startswith(ignored_prefixes):
            continue
        fused = _fused_qkv_piece(rel, params) if rel not in params else None
        if rel not in params and fused is None:
            raise ValueError(f"unexpected {kind} weight {name!r}")
        target = params[rel].data if fused is None else params[fused[0]].data.chunk(3, dim=0)[fused[1]]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor)
        loaded.add(rel)
    return loaded
