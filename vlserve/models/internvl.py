"""InternVL (`InternVLForConditionalGeneration`, InternVL3 in the transformers layout): the InternViT tower
(vlserve.encoders.intern_vit), pixel shuffle by `downsample_ratio`, an MLP projector (LayerNorm, Linear, GELU,
Linear) and a Qwen2 decoder (vlserve's LlamaDecoderModel) with plain 1-D RoPE.

Flow per step (the runner drives it):
  1. `embed_multimodal("image", data)` for every image the scheduler released, tiles concatenated in item order:
     data = {"pixel_values": [N, C, S, S]} (each image: its crop_to_patches tiles plus a thumbnail) -> `[N * F, H]`,
     F = (S / patch)**2 * downsample_ratio**2 tokens per tile. Videos come one feature per frame
     (vlserve.multimodal.internvl_items): `embed_multimodal("video", {"pixel_values_videos": [N, C, S, S]})`, every
     frame one tile through the same tower and projector.
  2. `get_input_embeddings(input_ids [T])` -> `[T, H]`; the runner writes image embeddings over the `<IMG_CONTEXT>`
     placeholders (the `<img>` / `</img>` tokens around each image keep their token embeddings).
  3. `forward(None, positions [T], kv_caches, attn_metadata, inputs_embeds)` -> hidden `[T, H]`;
     `compute_logits(hidden [N, H])` -> `[N, V]` float32.
T = tokens in the step, H = LLM hidden size, V = vocab size, E = tower width, k = 1 / downsample_ratio.
"""

from __future__ import annotations

import torch
from torch import nn

from vlserve.encoders.intern_vit import InternVitConfig, InternVitTower
from vlserve.kernels.activation import activation
from vlserve.kernels.packed_linear import PackableLinear
from vlserve.models.capabilities import DECODER_LORA_TARGETS, ModelCapabilities
from vlserve.models.llava import decoder_kwargs_for
from vlserve.models.mm_wrapper import MultiModalLM
from vlserve.models.registry import register_model

# Checkpoint prefixes, longest first: 5.x writes `model.<part>.`, 4.57 the top-level names.
_PREFIXES = (
    ("model.vision_tower.", "vision_tower"),
    ("vision_tower.", "vision_tower"),
    ("model.multi_modal_projector.", "multi_modal_projector"),
    ("multi_modal_projector.", "multi_modal_projector"),
    ("model.language_model.", "language_model"),
    ("language_model.model.", "language_model"),
)
# Tower weights HF may save that we never compute with (masked image modeling).
_UNUSED_TOWER_WEIGHTS = ("embeddings.mask_token",)


def shuffle_factor(downsample_ratio: float) -> int:
    """k = 1 / downsample_ratio as an integer >= 1; ValueError for ratios whose inverse is not one."""
    k = round(1 / float(downsample_ratio))
    if k < 1 or abs(k * float(downsample_ratio) - 1) > 1e-6:
        raise ValueError(f"downsample_ratio must be 1/k for an integer k, got {downsample_ratio}")
    return k


def pixel_shuffle(x: torch.Tensor, k: int) -> torch.Tensor:
    """Fold each k x k block of the feature grid into the channels, in HF InternVL's element order:
    `[N, G, G, E]` -> `[N, G/k, G/k, E * k * k]`."""
    n, rows, cols, width = x.shape
    if rows % k or cols % k:
        raise ValueError(f"feature grid {rows}x{cols} is not divisible by the shuffle factor {k}")
    x = x.reshape(n, rows, cols // k, width * k).transpose(1, 2)  # [N, G/k, G, E*k]
    x = x.reshape(n, cols // k, rows // k, width * k * k).transpose(1, 2)  # [N, G/k, G/k, E*k*k]
    return x.contiguous()


class InternVLProjector(nn.Module):
    """layer_norm -> linear_1 -> activation -> linear_2: shuffled features `[.., E * k * k]` -> `[.., H]`."""

    def __init__(self, in_dim: int, out_dim: int, act: str) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(in_dim)
        self.linear_1 = PackableLinear(in_dim, out_dim)
        self.linear_2 = PackableLinear(out_dim, out_dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


class InternVLForConditionalGeneration(MultiModalLM):
    """InternVL: `vision_tower` (InternViT) + pixel shuffle + `multi_modal_projector` + `language_model` + `lm_head`.

    Loads the 5.x layout (`model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`,
    `lm_head.weight`) and 4.57's (`vision_tower.*`, `multi_modal_projector.*`, `language_model.model.*`,
    `language_model.lm_head.weight`); the original OpenGVLab remote-code layout is not read.
    """

    capabilities = ModelCapabilities(
        modalities=("image", "video"),
        tensor_parallel=True,
        lora_targets=DECODER_LORA_TARGETS,
        encoder_lora=True,
        mm_encoder_only=True,
    )
    weight_prefixes = _PREFIXES
    copied_parts = ("vision_tower", "multi_modal_projector")

    def __init__(self, config) -> None:
        super().__init__(config)
        self.vision_tower = InternVitTower(InternVitConfig.from_hf(config.vision_config))
        layer = getattr(config, "vision_feature_layer", -1)
        if not isinstance(layer, int):
            raise ValueError(f"InternVL vision_feature_layer must be one int, got {str(layer)[:40]}")
        self.feature_layer = layer
        strategy = getattr(config, "vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full', got {str(strategy)[:40]!r}")
        self.drop_cls = strategy == "default"
        self.shuffle = shuffle_factor(getattr(config, "downsample_ratio", 0.5))
        self.multi_modal_projector = InternVLProjector(
            self.vision_tower.cfg.width * self.shuffle**2,
            self.text_config.hidden_size,
            getattr(config, "projector_hidden_act", "gelu"),
        )
        self.build_language_model(**decoder_kwargs_for(self.text_config))

    def _load_extra(self, part: str, rel: str, tensor: torch.Tensor) -> str | None:
        """Accept (and drop) the tower weights listed in `_UNUSED_TOWER_WEIGHTS`."""
        return f"{part}.{rel}" if part == "vision_tower" and rel in _UNUSED_TOWER_WEIGHTS else None

    # ---- multimodal ------------------------------------------------------------------------------------------------

    def tile_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """`pixels [N, C, S, S]` -> projected features of every tile `[N, F, H]`."""
        feats = self.vision_tower(pixels, self.feature_layer)  # [N, 1 + G*G, E]
        if self.drop_cls:
            feats = feats[:, 1:]
        n, length, width = feats.shape
        side = int(round(length**0.5))
        if side * side != length:
            raise ValueError(f"{length} tower features per tile do not form a square grid")
        grid = pixel_shuffle(feats.reshape(n, side, side, width), self.shuffle)  # [N, G/k, G/k, E*k*k]
        return self.multi_modal_projector(grid.reshape(n, -1, grid.shape[-1]))  # [N, F, H]

    @torch.no_grad()
    def embed_multimodal(self, modality: str, data: dict) -> torch.Tensor:
        """Tiles of the step's images (`data["pixel_values"]`) or video frames (`data["pixel_values_videos"]`),
        `[N, C, S, S]` -> `[N * F, H]`."""
        key = {"image": "pixel_values", "video": "pixel_values_videos"}.get(modality)
        if key is None:
            raise ValueError(f"{type(self).__name__} supports image and video inputs, not {modality!r}")
        feats = self.tile_features(data[key])
        return feats.reshape(-1, feats.shape[-1]).to(self.embed_dtype)


register_model("InternVLForConditionalGeneration", "vlserve.models.internvl:InternVLForConditionalGeneration")
