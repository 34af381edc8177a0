"""PerceptionLM: a timm-built vision tower (vlserve.encoders.TimmVisionTower, run as timm builds it) -> our projector
(linear-GELU-linear, then 2-D adaptive average pooling) -> a Llama decoder over the paged KV cache.

One image is a stack of tiles (a thumbnail plus up to `max_num_tiles` crops, as the HF image processor cut it); each
tile gives (S/p / r)**2 embeddings (S tile size, p patch size, r projector_pooling_ratio), tiles in order.
N = tiles in a step, L = tokens per tile from the tower (CLS first), D = tower width, H = LLM hidden size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vlserve.encoders.timm_tower import TimmVisionTower, timm_tower_args
from vlserve.kernels.packed_linear import PackableLinear
from vlserve.models.capabilities import DECODER_LORA_TARGETS, ModelCapabilities
from vlserve.models.mm_wrapper import MultiModalLM
from vlserve.models.registry import register_model


class PerceptionLMProjector(nn.Module):
    """`[N, L', D]` tower tokens -> `[N, L'', H]`: linear_1, GELU, linear_2, then (pooling_ratio > 1) adaptive
    average pooling of the square token grid down to (side / pooling_ratio)**2 tokens."""

    def __init__(self, in_features: int, hidden_size: int, pooling_ratio: int) -> None:
        super().__init__()
        self.linear_1 = PackableLinear(in_features, hidden_size, bias=True)
        self.linear_2 = PackableLinear(hidden_size, hidden_size, bias=True)
        self.pooling_ratio = int(pooling_ratio)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.linear_2(F.gelu(self.linear_1(features)))  # [N, L', H]
        if self.pooling_ratio <= 1:
            return x
        n, tokens, hidden = x.shape
        side = math.isqrt(tokens)
        if side * side != tokens:
            raise ValueError(f"PerceptionLM pooling needs a square token grid per tile, got {tokens} tokens")
        out = side // self.pooling_ratio
        grid = x.transpose(1, 2).reshape(n, hidden, side, side)  # [N, H, side, side]
        pooled = F.adaptive_avg_pool2d(grid, (out, out))  # [N, H, out, out]
        return pooled.flatten(2).transpose(1, 2)  # [N, out*out, H]


class PerceptionLMForConditionalGeneration(MultiModalLM):
    """`vision_tower` (timm) + `multi_modal_projector` + `language_model` (Llama decoder) + `lm_head`.

    Checkpoint names: `model.vision_tower.timm_model.*` (timm's own names), `model.multi_modal_projector.*`,
    `model.language_model.*`, `lm_head.weight` (what transformers 4.57 and 5.x both save), plus the older
    `vision_tower.*` / `multi_modal_projector.*` / `language_model.model.*` / `language_model.lm_head.*` spelling.
    """

    capabilities = ModelCapabilities(
        modalities=("image",),
        tensor_parallel=True,
        lora_targets=DECODER_LORA_TARGETS,
        encoder_lora=True,
        mm_encoder_only=True,
    )
    weight_prefixes = (
        ("model.vision_tower.timm_model.", "vision_tower"),
        ("vision_tower.timm_model.", "vision_tower"),
        ("model.multi_modal_projector.", "multi_modal_projector"),
        ("multi_modal_projector.", "multi_modal_projector"),
        ("model.language_model.", "language_model"),
        ("language_model.model.", "language_model"),
    )
    copied_parts = ("multi_modal_projector",)
    delegated_parts = ("vision_tower",)

    def __init__(self, config) -> None:
        super().__init__(config)
        architecture, model_args = timm_tower_args(config.vision_config)
        self.vision_tower = TimmVisionTower(architecture, model_args)
        self.use_cls_token = bool(getattr(config, "vision_use_cls_token", True))
        width = int(model_args.get("embed_dim") or self.vision_tower.num_features)
        self.multi_modal_projector = PerceptionLMProjector(
            width, self.text_config.hidden_size, int(getattr(config, "projector_pooling_ratio", 1) or 1)
        )
        self.build_language_model()

    # ---- multimodal ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def embed_multimodal(self, modality: str, data: dict) -> torch.Tensor:
        """Tiles of one or more images (concatenated in item order) -> `[num_embeds, H]`.

        data = {"pixel_values": [N, C, S, S]} (N = all tiles of all items); num_embeds = N * tokens per tile.
        """
        if modality != "image":
            raise ValueError(f"{type(self).__name__} takes image inputs, not {modality!r}")
        pixels = data["pixel_values"]
        if pixels.dim() == 5:  # [B, tiles, C, S, S] as the HF processor batches it
            pixels = pixels.flatten(0, 1)
        features = self.vision_tower(pixels)  # [N, L, D]
        if self.use_cls_token:
            features = features[:, 1:, :]  # [N, L - 1, D]
        embeds = self.multi_modal_projector(features)  # [N, per tile, H]
        return embeds.reshape(-1, embeds.shape[-1]).to(self.embed_dtype)


register_model(
    "PerceptionLMForConditionalGeneration", "vlserve.models.perception_lm:PerceptionLMForConditionalGeneration"
)
