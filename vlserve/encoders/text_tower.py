"""The CLIP / SigLIP text transformer on vlserve's kernels: token + learned absolute position embeddings, the ViT
encoder layers of clip_vision.py (packable linears) with masked attention, and final_layer_norm.

`ContrastiveTextTower(cfg)(input_ids [B, T], attention_mask [B, T] | None)` -> `[B, T, E]`, the last hidden state
after final_layer_norm (HF's `CLIPTextModel` / `SiglipTextModel(...).last_hidden_state`); `forward_unpadded` returns
the unpadded tokens' rows only `[R, E]` and never computes a padded position. The linears, norms and MLPs run on the
computed rows packed `[R, E]`; only attention sees the padded `[B, T]` layout. CLIP attends causally
(`cfg.causal`), SigLIP both ways; padded keys (attention_mask 0) are never attended to. Positions are the token's
index in the padded row, as HF's are. Pooling is the model's (vlserve.models.dual_tower); SigLIP's `head` linear
lives here because its checkpoints keep it under `text_model.head`. Module names follow HF's so weights load by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlserve.encoders.clip_vision import VitAttention, VitEncoderLayer, copy_tower_weights, tower_weight_names
from vlserve.encoders.vision_layers import AttentionSegments
from vlserve.kernels.packed_linear import PackableLinear


@dataclass(frozen=True)
class TextTowerConfig:
    """The fields of a CLIP / SigLIP `text_config` the tower reads (plus whether it attends causally)."""

    depth: int
    width: int  # E
    num_heads: int
    mlp_hidden: int
    hidden_act: str
    layer_norm_eps: float
    vocab_size: int
    max_positions: int
    causal: bool
    head_out: int | None = None  # SigLIP's `head` linear [E -> head_out]; None for CLIP (no head)

    @classmethod
    def from_hf(cls, text_config, causal: bool, head_out: int | None = None) -> TextTowerConfig:
        """Read an HF CLIPTextConfig / SiglipTextConfig."""
        return cls(
            depth=text_config.num_hidden_layers,
            width=text_config.hidden_size,
            num_heads=text_config.num_attention_heads,
            mlp_hidden=text_config.intermediate_size,
            hidden_act=text_config.hidden_act,
            layer_norm_eps=text_config.layer_norm_eps,
            vocab_size=text_config.vocab_size,
            max_positions=text_config.max_position_embeddings,
            causal=causal,
            head_out=head_out,
        )


def text_attention_mask(attention_mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """`attention_mask [B, T]` (1 = token, 0 = padding) -> boolean `[B, 1, T, T]` (True = may attend): padded keys
    are masked, and later keys too when `causal`. A query with no key left (a left-padded causal row) attends to
    itself only, so no row is all-masked (its output is never pooled)."""
    num_tokens = attention_mask.shape[1]
    allowed = attention_mask.bool()[:, None, None, :].expand(-1, 1, num_tokens, -1)  # [B, 1, T, T]
    if causal:
        allowed = allowed & torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=allowed.device).tril()
    eye = torch.eye(num_tokens, dtype=torch.bool, device=allowed.device)
    return allowed | (eye & ~allowed.any(dim=-1, keepdim=True))


@dataclass
class TextRows:
    """The rows of a padded `[B, T]` batch the tower computes: linears, norms and MLPs run on those rows only
    (`[R, E]`); attention scatters q / k / v into the padded layout and attends under `mask`."""

    batch: int  # B
    num_tokens: int  # T
    flat_rows: torch.Tensor | None  # [R] int64: b * T + t of each computed row, in order; None = all B * T rows
    mask: torch.Tensor | None  # [B, 1, T, T] bool (text_attention_mask); None when `segments` is set
    # one segment per text when the computed rows are exactly the texts' tokens (no padded row computed): attention
    # then runs on the packed rows (VitAttention's varlen path); None: in the padded layout under `mask`
    segments: AttentionSegments | None = None
    # [3, B*T, C]: q / k / v in the padded layout, zero but for the computed rows (which every layer overwrites)
    padded: torch.Tensor | None = None

    def to_padded(self, rows: torch.Tensor, slot: int) -> torch.Tensor:
        """`rows [R, C]` (slot 0 / 1 / 2: q / k / v) -> `[B, T, C]`, zeros where no row was computed."""
        if self.flat_rows is None:
            return rows.view(self.batch, self.num_tokens, -1)
        if self.padded is None:
            self.padded = rows.new_zeros(3, self.batch * self.num_tokens, rows.shape[1])
        full = self.padded[slot].index_copy_(0, self.flat_rows, rows)  # [B*T, C]
        return full.view(self.batch, self.num_tokens, -1)

    def from_padded(self, padded: torch.Tensor) -> torch.Tensor:
        """`[B, T, ...]` (any strides) -> the computed rows `[R, ...]`."""
        if self.flat_rows is None:
            return padded.flatten(0, 1)
        return padded[self.flat_rows // self.num_tokens, self.flat_rows % self.num_tokens]


class TextAttention(VitAttention):
    """The ViT attention's projections on the computed rows. When those are exactly the texts' tokens, attention
    runs on them packed, one segment per text (causal or not, `kernels.varlen_attention`): a text's tokens see its
    own tokens only, as the mask would allow. Otherwise in the padded layout under the `[B, 1, T, T]` boolean mask
    (scaled_dot_product_attention); keys never computed are masked there."""

    def forward(self, x: torch.Tensor, rows: TextRows, keep: torch.Tensor | None = None) -> torch.Tensor:
        # x: [R, E] -> [R, E], or [K, E]: the rows `keep [K]` alone through out_proj
        if rows.segments is not None:
            return super().forward(x, rows.segments, keep)
        batch, num_tokens = rows.batch, rows.num_tokens

        def heads(projected: torch.Tensor, slot: int) -> torch.Tensor:
            padded = rows.to_padded(projected, slot)  # [B, T, E]
            return padded.view(batch, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, Hd]

        q, k, v = (heads(projected, slot) for slot, projected in enumerate(self.project_qkv(x)))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=rows.mask, scale=self.head_dim**-0.5)  # [B, H, T, Hd]
        out = rows.from_padded(out.transpose(1, 2))  # [R, H, Hd]
        out = out.reshape(out.shape[0], -1)  # [R, E]
        return self.out_proj(out if keep is None else out.index_select(0, keep))


class TextEncoderLayer(VitEncoderLayer):
    """The ViT pre-norm block with TextAttention: `forward(x [R, E], rows: TextRows)`."""

    def __init__(self, cfg: TextTowerConfig) -> None:
        super().__init__(cfg)
        self.self_attn = TextAttention(cfg, fused_qkv=True)


class TextEncoder(nn.Module):
    """`layers.N` as in HF."""

    def __init__(self, cfg: TextTowerConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TextEncoderLayer(cfg) for _ in range(cfg.depth))

    def forward(self, x: torch.Tensor, rows: TextRows, keep: torch.Tensor | None = None) -> torch.Tensor:
        # x: [R, E] -> [R, E], or [K, E]: the last layer's output at the rows `keep [K]` alone
        for layer in self.layers[:-1]:
            x = layer(x, rows)
        return self.layers[-1](x, rows, keep)


class TextEmbeddings(nn.Module):
    """Token embedding + learned absolute positions 0..T-1."""

    def __init__(self, cfg: TextTowerConfig) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.width)
        self.position_embedding = nn.Embedding(cfg.max_positions, cfg.width)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [B, T] -> [B, T, E]
        return self.token_embedding(input_ids) + self.position_embedding.weight[: input_ids.shape[1]]


class ContrastiveTextTower(nn.Module):
    """CLIP's or SigLIP's text transformer up to final_layer_norm (and SigLIP's `head`, applied by the caller)."""

    def __init__(self, cfg: TextTowerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = TextEmbeddings(cfg)
        self.encoder = TextEncoder(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        if cfg.head_out is not None:
            self.head = PackableLinear(cfg.width, cfg.head_out)

    def check_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """ValueError unless `input_ids` is a non-empty `[B, T]` integer tensor of in-vocabulary ids with T within
        the position table and `attention_mask` (if given) a 0/1 `[B, T]`; returns the mask (all ones if None)."""
        if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be a non-empty [B, T] tensor, got {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
        if input_ids.shape[1] > self.cfg.max_positions:
            raise ValueError(f"text of {input_ids.shape[1]} tokens exceeds the {self.cfg.max_positions} positions")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.cfg.vocab_size:
            raise ValueError(f"input_ids must lie in [0, {self.cfg.vocab_size})")
        if attention_mask is None:
            return torch.ones_like(input_ids)
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} differs from input_ids {tuple(input_ids.shape)}"
            )
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask must hold only 0 and 1")
        return attention_mask

    def _encode(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, unpadded_only: bool, out_rows: torch.Tensor | None
    ) -> torch.Tensor:
        # input_ids, attention_mask: [B, T] (checked) -> [R, E]: every row, or the unpadded ones only; [K, E]: the
        # rows `out_rows` of those alone
        device = self.embeddings.token_embedding.weight.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        out_rows = None if out_rows is None else out_rows.to(device)
        batch, num_tokens = input_ids.shape
        keep = attention_mask.bool().flatten()  # [B*T]
        padded = not bool(keep.all())
        flat_rows = keep.nonzero().squeeze(1) if unpadded_only and padded else None  # [R]
        segments = None
        if unpadded_only or not padded:  # the computed rows are the texts' tokens, text after text
            lengths = attention_mask.sum(dim=1).tolist()
            segments = AttentionSegments.from_lengths(lengths, device, causal=self.cfg.causal)
        mask = text_attention_mask(attention_mask, self.cfg.causal) if segments is None else None
        rows = TextRows(batch, num_tokens, flat_rows, mask, segments=segments)
        x = rows.from_padded(self.embeddings(input_ids))  # [R, E]
        return self.final_layer_norm(self.encoder(x, rows, out_rows))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`input_ids [B, T]`, `attention_mask [B, T]` or None (no padding) -> `[B, T, E]` after final_layer_norm,
        padded positions included (HF's last_hidden_state)."""
        attention_mask = self.check_inputs(input_ids, attention_mask)
        return self._encode(input_ids, attention_mask, False, None).view(*input_ids.shape, -1)

    def forward_unpadded(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, out_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`input_ids [B, T]`, `attention_mask [B, T]` -> the unpadded tokens' last hidden states `[R, E]`
        (R = attention_mask.sum(), row-major order), or with `out_rows [K]` (increasing indices into those R rows)
        theirs alone `[K, E]`: the last layer computes no other row past its attention. Padded positions are never
        computed: a causal tower's unpadded tokens come out as in `forward`, and a bidirectional one's too (padded
        keys are masked there)."""
        attention_mask = self.check_inputs(input_ids, attention_mask)
        return self._encode(input_ids, attention_mask, True, out_rows)

    def expected_weight_names(self) -> set[str]:
        """The names `load_weights` reports for a whole checkpoint, relative to the tower (`tower_weight_names`)."""
        return tower_weight_names(self)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors (relative to the tower, with or without `text_model.`) into the parameters;
        returns the names filled (q/k/v by their checkpoint names). ValueError on an unknown name or a shape
        mismatch."""
        return copy_tower_weights(self, weights, "text_model.", "text tower")
