"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a CLIP or SigLIP vision tower (vlserve.encoders), a two-layer
projector and any Llama-style decoder we load (Llama, Mistral, Qwen2, Qwen3 through vlserve's LlamaDecoderModel),
with plain 1-D RoPE.

Flow per step (the runner drives it):
  1. `embed_multimodal("image", data)` for every image the scheduler released, pixels concatenated:
     data = {"pixel_values": [N, C, S, S]} -> `[N * F, H]` (F = features per image: patches, plus the class token
     under the "full" strategy with CLIP).
  2. `get_input_embeddings(input_ids [T])` -> `[T, H]`; the runner writes image embeddings over the placeholders.
  3. `forward(None, positions [T], kv_caches, attn_metadata, inputs_embeds)` -> hidden `[T, H]`;
     `compute_logits(hidden [N, H])` -> `[N, V]` float32.
T = tokens in the step, H = LLM hidden size, V = vocab size, E = tower width.
"""

from __future__ import annotations

import torch
from torch import nn

from vlserve.encoders.clip_vision import ClipVisionTower, VitConfig, feature_layer_indices
from vlserve.encoders.siglip_vision import SiglipVisionTower
from vlserve.kernels.activation import activation
from vlserve.kernels.packed_linear import PackableLinear
from vlserve.models.capabilities import DECODER_LORA_TARGETS, ModelCapabilities
from vlserve.models.mm_wrapper import MultiModalLM
from vlserve.models.registry import register_model

_TOWERS = {"clip_vision_model": ClipVisionTower, "siglip_vision_model": SiglipVisionTower}
# Checkpoint prefixes, longest first: 5.x writes `model.<part>.`, 4.57 the top-level names.
_PREFIXES = (
    ("model.vision_tower.", "vision_tower"),
    ("vision_tower.", "vision_tower"),
    ("model.multi_modal_projector.", "multi_modal_projector"),
    ("multi_modal_projector.", "multi_modal_projector"),
    ("model.language_model.", "language_model"),
    ("language_model.model.", "language_model"),
    ("model.image_newline", "image_newline"),
    ("image_newline", "image_newline"),
)


def decoder_kwargs_for(text_config) -> dict:
    """LlamaDecoderModel options for a LLaVA text config: Qwen2 has q/k/v biases, Qwen3 per-head q/k norms."""
    model_type = getattr(text_config, "model_type", "")
    if model_type == "qwen2":
        return {"qkv_bias": True, "o_bias": False}
    if model_type == "qwen3":
        return {"qk_norm": True}
    return {}


def build_vision_tower(vision_config) -> ClipVisionTower:
    """A CLIP or SigLIP tower for the config; ValueError naming any other tower type."""
    kind = getattr(vision_config, "model_type", "")
    if kind not in _TOWERS:
        raise ValueError(f"LLaVA vision tower {str(kind)[:60]!r} is not supported; expected one of {sorted(_TOWERS)}")
    return _TOWERS[kind](VitConfig.from_hf(vision_config))


class LlavaProjector(nn.Module):
    """linear_1 -> activation -> linear_2: tower features `[.., E * k]` -> `[.., H]` (biases as configured)."""

    def __init__(self, in_dim: int, out_dim: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = PackableLinear(in_dim, out_dim, bias=bias)
        self.linear_2 = PackableLinear(out_dim, out_dim, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(MultiModalLM):
    """LLaVA: `vision_tower` + `multi_modal_projector` + `language_model` (LlamaDecoderModel) + `lm_head`.

    Loads both checkpoint layouts: 4.57's (`vision_tower.*`, `multi_modal_projector.*`, `language_model.model.*`,
    `language_model.lm_head.weight`) and 5.x's (`model.vision_tower.*`, `model.multi_modal_projector.*`,
    `model.language_model.*`, `lm_head.weight`); tower names with or without `vision_model.`.
    """

    # over pipeline stages: the tower and projector on the first stage (LLaVA-NeXT's image_newline too)
    capabilities = ModelCapabilities(
        modalities=("image",),
        pipeline_parallel=True,
        tensor_parallel=True,
        lora_targets=DECODER_LORA_TARGETS,
        encoder_lora=True,
        mm_encoder_only=True,
    )
    weight_prefixes = _PREFIXES
    copied_parts = ("multi_modal_projector",)
    delegated_parts = ("vision_tower",)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.vision_tower = build_vision_tower(config.vision_config)
        self.feature_layers = feature_layer_indices(config.vision_feature_layer, self.vision_tower.cfg.depth)
        strategy = getattr(config, "vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full', got {str(strategy)[:40]!r}")
        self.drop_cls = strategy == "default"
        self.multi_modal_projector = LlavaProjector(
            self.vision_tower.cfg.width * len(self.feature_layers),
            self.text_config.hidden_size,
            getattr(config, "projector_hidden_act", "gelu"),
            bool(getattr(config, "multimodal_projector_bias", True)),
        )
        self.build_language_model(**decoder_kwargs_for(self.text_config))

    # ---- multimodal ------------------------------------------------------------------------------------------------

    def tile_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """`pixels [N, C, S, S]` -> projected features of every tile `[N, F, H]` (class token dropped under the
        "default" strategy)."""
        feats = self.vision_tower(pixels, self.feature_layers)  # [N, L, E * k]
        if self.drop_cls:
            feats = feats[:, 1:]
        return self.multi_modal_projector(feats)  # [N, F, H]

    @torch.no_grad()
    def embed_multimodal(self, modality: str, data: dict) -> torch.Tensor:
        """Images of the step, `data["pixel_values"] [N, C, S, S]` -> `[N * F, H]` in item order."""
        if modality != "image":
            raise ValueError(f"{type(self).__name__} supports image inputs, not {modality!r}")
        feats = self.tile_features(data["pixel_values"])
        return feats.reshape(-1, feats.shape[-1]).to(self.embed_dtype)


register_model("LlavaForConditionalGeneration", "vlserve.models.llava:LlavaForConditionalGeneration")
