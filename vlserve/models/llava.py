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

from typing import Iterable

import torch
from torch import nn

from vlserve.encoders.clip_vision import ClipVisionTower, VitConfig, feature_layer_indices
from vlserve.encoders.siglip_vision import SiglipVisionTower
from vlserve.kernels.activation import activation
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.models.hf_config import text_config_of, tie_word_embeddings_of, token_id_of
from vlserve.models.llama import LlamaDecoderModel
from vlserve.models.registry import register_model

_TOWERS = {"clip_vision_model": ClipVisionTower, "siglip_vision_model": SiglipVisionTower}
# Checkpoint prefixes, longest first: 5.x writes `model.<part>.`, 4.57 the top-level names.
_PREFIXES = (("model.vision_tower.", "vision_tower"), ("vision_tower.", "vision_tower"),
             ("model.multi_modal_projector.", "projector"), ("multi_modal_projector.", "projector"),
             ("model.language_model.", "language_model"), ("language_model.model.", "language_model"),
             ("model.image_newline", "image_newline"), ("image_newline", "image_newline"))
_LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")


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
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=bias)
        self.linear_2 = nn.Linear(out_dim, out_dim, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
    """LLaVA: `vision_tower` + `multi_modal_projector` + `language_model` (LlamaDecoderModel) + `lm_head`.

    Loads both checkpoint layouts: 4.57's (`vision_tower.*`, `multi_modal_projector.*`, `language_model.model.*`,
    `language_model.lm_head.weight`) and 5.x's (`model.vision_tower.*`, `model.multi_modal_projector.*`,
    `model.language_model.*`, `lm_head.weight`); tower names with or without `vision_model.`.
    """

    supports_multimodal = True
    uses_mrope = False
    supported_modalities = ("image",)

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.text_config = text_config_of(config)
        self.vision_tower = build_vision_tower(config.vision_config)
        self.feature_layers = feature_layer_indices(config.vision_feature_layer, self.vision_tower.cfg.depth)
        strategy = getattr(config, "vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full', got {str(strategy)[:40]!r}")
        self.drop_cls = strategy == "default"
        self.multi_modal_projector = LlavaProjector(
            self.vision_tower.cfg.width * len(self.feature_layers), self.text_config.hidden_size,
            getattr(config, "projector_hidden_act", "gelu"), bool(getattr(config, "multimodal_projector_bias", True)))
        self.language_model = LlamaDecoderModel(self.text_config, **decoder_kwargs_for(self.text_config))
        self.lm_head = nn.Linear(self.text_config.hidden_size, self.text_config.vocab_size, bias=False)
        image_token = token_id_of(config, "image_token_id")
        self.image_token_id = image_token if image_token is not None else token_id_of(config, "image_token_index")
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
        return feats.reshape(-1, feats.shape[-1]).to(self.language_model.embed_tokens.weight.dtype)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings `input_ids [T]` -> `[T, H]`."""
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
        """Checkpoint name -> (part, name relative to it); part "" for names of no known part."""
        if name in _LM_HEAD_NAMES:
            return "lm_head", "weight"
        for prefix, part in _PREFIXES:
            if name.startswith(prefix):
                return part, name[len(prefix):]
        return "", name

    def _load_extra(self, part: str, rel: str, tensor: torch.Tensor) -> str | None:
        """Hook for parts beyond tower / projector / decoder / lm_head; returns the loaded name or None."""
        return None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a full HF checkpoint (either layout); ValueError lists missing/unexpected/mis-shaped names."""
        proj_params = dict(self.multi_modal_projector.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        tower_weights: list[tuple[str, torch.Tensor]] = []

        def decoder_weights():
            for name, tensor in weights:
                part, rel = self._split_name(name)
                if part == "language_model":
                    yield rel, tensor
                elif part == "vision_tower":
                    tower_weights.append((rel, tensor))
                elif part == "projector" and rel in proj_params:
                    _copy(proj_params[rel], tensor, name)
                    loaded.add("multi_modal_projector." + rel)
                elif part == "lm_head":
                    if not self.tied:
                        _copy(self.lm_head.weight, tensor, name)
                        loaded.add("lm_head.weight")
                else:
                    extra = self._load_extra(part, rel, tensor)
                    if extra is None:
                        unexpected.append(name)
                    else:
                        loaded.add(extra)

        loaded.update("language_model." + n for n in self.language_model.load_weights(decoder_weights()))
        loaded.update("vision_tower." + n for n in self.vision_tower.load_weights(tower_weights))
        if unexpected:
            raise ValueError(f"unexpected weights in checkpoint: {unexpected[:10]}")
        expected = {"language_model." + n for n in self.language_model.expected_weight_names()}
        expected.update(n for n, _ in self.named_parameters() if not n.startswith(("language_model.", "lm_head.")))
        if not self.tied:
            expected.add("lm_head.weight")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:10]}")


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor)


register_model("LlavaForConditionalGeneration", "vlserve.models.llava:LlavaForConditionalGeneration")
