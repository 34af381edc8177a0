"""PerceptionLM: a timm-built vision tower (vlserve.encoders.TimmVisionTower, run as timm builds it) -> our projector
(linear-GELU-linear, then 2-D adaptive average pooling) -> a Llama decoder over the paged KV cache.

One image is a stack of tiles (a thumbnail plus up to `max_num_tiles` crops, as the HF image processor cut it); each
tile gives (S/p / r)**2 embeddings (S tile size, p patch size, r projector_pooling_ratio), tiles in order.
N = tiles in a step, L = tokens per tile from the tower (CLS first), D = tower width, H = LLM hidden size.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vlserve.encoders.timm_tower import TimmVisionTower, timm_tower_args
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.models.hf_config import tie_word_embeddings_of
from vlserve.models.llama import LlamaDecoderModel
from vlserve.models.registry import register_model

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class PerceptionLMProjector(nn.Module):
    """`[N, L', D]` tower tokens -> `[N, L'', H]`: linear_1, GELU, linear_2, then (pooling_ratio > 1) adaptive
    average pooling of the square token grid down to (side / pooling_ratio)**2 tokens."""

    def __init__(self, in_features: int, hidden_size: int, pooling_ratio: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden_size, bias=True)
        self.linear_2 = nn.Linear(hidden_size, hidden_size, bias=True)
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


class PerceptionLMForConditionalGeneration(nn.Module):
    """`vision_tower` (timm) + `multi_modal_projector` + `language_model` (Llama decoder) + `lm_head`.

    Checkpoint names: `model.vision_tower.timm_model.*` (timm's own names), `model.multi_modal_projector.*`,
    `model.language_model.*`, `lm_head.weight` (what transformers 4.57 and 5.x both save), plus the older
    `vision_tower.*` / `multi_modal_projector.*` / `language_model.model.*` / `language_model.lm_head.*` spelling.
    """

    supports_multimodal = True
    uses_mrope = False
    supported_modalities = ("image",)

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.text_config = config.text_config
        architecture, model_args = timm_tower_args(config.vision_config)
        self.vision_tower = TimmVisionTower(architecture, model_args)
        self.use_cls_token = bool(getattr(config, "vision_use_cls_token", True))
        width = int(model_args.get("embed_dim") or self.vision_tower.num_features)
        self.multi_modal_projector = PerceptionLMProjector(
            width, self.text_config.hidden_size, int(getattr(config, "projector_pooling_ratio", 1) or 1))
        self.language_model = LlamaDecoderModel(self.text_config)
        self.lm_head = nn.Linear(self.text_config.hidden_size, self.text_config.vocab_size, bias=False)
        self.image_token_id = config.image_token_id
        self.tie_weights()

    @property
    def tied(self) -> bool:
        """Whether lm_head shares the input embedding matrix."""
        return tie_word_embeddings_of(self.config)

    def tie_weights(self) -> None:
        """Point lm_head at the embedding matrix when the config ties them (re-run after materializing)."""
        if self.tied:
            self.lm_head.weight = self.language_model.embed_tokens.weight

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
        return embeds.reshape(-1, embeds.shape[-1]).to(self.language_model.embed_tokens.weight.dtype)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings `input_ids [T]` -> `[T, H]` (the runner writes image embeddings over placeholders)."""
        return self.language_model.get_input_embeddings(input_ids)

    # ---- language model ------------------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attn_metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Flattened step -> final hidden states `[T, H]`; positions `[T]`."""
        return self.language_model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden [N, H]` -> logits `[N, V]` float32."""
        return self.lm_head(hidden).float()

    # ---- weights -------------------------------------------------------------------------------------------------

    @staticmethod
    def _split_name(name: str) -> tuple[str, str]:
        """Checkpoint name -> (part, name relative to it); part is "vision" / "projector" / "decoder" /
        "lm_head" / "" (unknown)."""
        for prefix, part in (("model.vision_tower.timm_model.", "vision"), ("vision_tower.timm_model.", "vision"),
                             ("model.multi_modal_projector.", "projector"), ("multi_modal_projector.", "projector"),
                             ("model.language_model.", "decoder"), ("language_model.model.", "decoder")):
            if name.startswith(prefix):
                return part, name[len(prefix):]
        if name in ("lm_head.weight", "language_model.lm_head.weight"):
            return "lm_head", "weight"
        return "", name

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a full HF checkpoint (either layout); ValueError lists missing/unexpected/mis-shaped names."""
        proj_params = dict(self.multi_modal_projector.named_parameters())
        vision: list[tuple[str, torch.Tensor]] = []
        loaded: set[str] = set()
        unexpected: list[str] = []

        def copy(dst: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)

        def decoder_weights():
            for name, tensor in weights:
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                part, rel = self._split_name(name)
                if part == "decoder":
                    yield rel, tensor
                elif part == "vision":
                    vision.append((rel, tensor))
                elif part == "projector" and rel in proj_params:
                    copy(proj_params[rel].data, name, tensor)
                    loaded.add("multi_modal_projector." + rel)
                elif part == "lm_head":
                    if not self.tied:
                        copy(self.lm_head.weight.data, name, tensor)
                        loaded.add("lm_head.weight")
                else:
                    unexpected.append(name)

        loaded.update("language_model." + n for n in self.language_model.load_weights(decoder_weights()))
        if unexpected:
            raise ValueError(f"unexpected weights in checkpoint: {unexpected[:10]}")
        loaded.update("vision_tower." + n for n in self.vision_tower.load_weights(vision))
        expected = {"language_model." + n for n in self.language_model.expected_weight_names()}
        expected.update("vision_tower." + n for n in self.vision_tower.expected_weight_names())
        expected.update("multi_modal_projector." + n for n in proj_params)
        if not self.tied:
            expected.add("lm_head.weight")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:10]}")


register_model("PerceptionLMForConditionalGeneration",
               "vlserve.models.perception_lm:PerceptionLMForConditionalGeneration")
