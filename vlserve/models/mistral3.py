"""Mistral 3 (`Mistral3ForConditionalGeneration`): the Pixtral vision tower (vlserve.encoders.pixtral_vision), a
projector that RMS-normalizes the tower's features, merges each spatial_merge_size x spatial_merge_size block of
patches into one (`patch_merger`), then runs linear_1 -> activation -> linear_2, and a Mistral / Llama decoder
(vlserve's LlamaDecoderModel) with plain 1-D RoPE.

Images keep their aspect ratio: an image of rows x cols merged patches fills a placeholder run of rows * (cols + 1)
tokens, `[IMG]` per column and `[IMG_BREAK]` after each row, the last one `[IMG_END]` (see
vlserve.multimodal.mistral3_items). `embed_multimodal` returns the whole run per image: the projected image
features with the break / end positions filled with those tokens' own input embeddings, so one item is one
contiguous run of embeddings.

Flow per step (the runner drives it):
  1. `embed_multimodal("image", data)` for every image the scheduler released: data = {"pixel_values" [P, C*p*p],
     "image_sizes" [N, 2], "special_token_ids" [N, 2]} -> `[sum of rows * (cols + 1), H]` in item order.
  2. `get_input_embeddings(input_ids [T])` -> `[T, H]`; the runner writes item embeddings over the placeholders.
  3. `forward(None, positions [T], kv_caches, attn_metadata, inputs_embeds)` -> hidden `[T, H]`;
     `compute_logits(hidden [N, H])` -> `[N, V]` float32.
T = tokens in the step, H = LLM hidden size, V = vocab size, E = tower width, m = spatial_merge_size.
"""

from __future__ import annotations

import torch
from torch import nn

from vlserve.encoders.clip_vision import feature_layer_indices
from vlserve.encoders.pixtral_vision import PatchGrid, PixtralConfig, PixtralVisionTower
from vlserve.encoders.vision_layers import RMSNorm
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


class Mistral3PatchMerger(nn.Module):
    """Concatenate each m x m block of an image's patches (HF's unfold order: feature-major, then the block's
    row-major offsets), then `merging_layer`: `[P, E]` -> `[P / m**2, E]`, blocks row-major per image."""

    def __init__(self, width: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = PackableLinear(width * merge**2, width, bias=False)

    def forward(self, x: torch.Tensor, grids: list[PatchGrid]) -> torch.Tensor:
        m, e = self.merge, x.shape[-1]
        blocks = []
        for feats, (h, w) in zip(x.split([h * w for h, w in grids]), grids):
            grid = feats.view(h // m, m, w // m, m, e)  # [h/m, m, w/m, m, E]
            blocks.append(grid.permute(0, 2, 4, 1, 3).reshape(-1, e * m * m))  # [(h/m)*(w/m), E*m*m]
        return self.merging_layer(torch.cat(blocks, dim=0))  # [P / m**2, E]


class Mistral3Projector(nn.Module):
    """norm -> patch_merger -> linear_1 -> activation -> linear_2: tower features `[P, E]` -> `[P / m**2, H]`."""

    def __init__(self, width: int, out_dim: int, merge: int, act: str, bias: bool, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(width, eps=eps)
        self.patch_merger = Mistral3PatchMerger(width, merge)
        self.linear_1 = PackableLinear(width, out_dim, bias=bias)
        self.act = activation(act)
        self.linear_2 = PackableLinear(out_dim, out_dim, bias=bias)

    def forward(self, x: torch.Tensor, grids: list[PatchGrid]) -> torch.Tensor:
        merged = self.patch_merger(self.norm(x), grids)  # [P / m**2, E]
        return self.linear_2(self.act(self.linear_1(merged)))  # [P / m**2, H]


class Mistral3ForConditionalGeneration(MultiModalLM):
    """Mistral 3: `vision_tower` (Pixtral) + `multi_modal_projector` + `language_model` (LlamaDecoderModel) +
    `lm_head`; loads 5.x's checkpoint layout (`model.vision_tower.*`, `model.multi_modal_projector.*`,
    `model.language_model.*`, `lm_head.weight`) and 4.57's top-level names."""

    capabilities = ModelCapabilities(
        modalities=("image",),
        tensor_parallel=True,
        lora_targets=DECODER_LORA_TARGETS,
        encoder_lora=True,
        mm_encoder_only=True,
    )
    weight_prefixes = _PREFIXES
    copied_parts = ("vision_tower", "multi_modal_projector")

    def __init__(self, config) -> None:
        super().__init__(config)
        feature_layer = getattr(config, "vision_feature_layer", -1)
        if not isinstance(feature_layer, int):  # HF's norm and merger take one layer's width only
            raise ValueError(f"Mistral 3 takes one vision_feature_layer (an int), got {str(feature_layer)[:40]}")
        self.vision_tower = PixtralVisionTower(PixtralConfig.from_hf(config.vision_config))
        self.feature_layers = feature_layer_indices(feature_layer, self.vision_tower.cfg.depth)
        self.merge = int(getattr(config, "spatial_merge_size", 2))
        self.multi_modal_projector = Mistral3Projector(
            self.vision_tower.cfg.width,
            self.text_config.hidden_size,
            self.merge,
            getattr(config, "projector_hidden_act", "gelu"),
            bool(getattr(config, "multimodal_projector_bias", False)),
            float(getattr(self.text_config, "rms_norm_eps", 1e-5)),
        )
        self.build_language_model(**decoder_kwargs_for(self.text_config))

    # ---- multimodal ------------------------------------------------------------------------------------------------

    def patch_grids(self, image_sizes: torch.Tensor) -> list[PatchGrid]:
        """`image_sizes [N, 2]` (pixels) -> each image's (rows, cols) in patches; ValueError unless both are
        multiples of spatial_merge_size."""
        p = self.vision_tower.cfg.patch_size
        grids = [(int(h) // p, int(w) // p) for h, w in image_sizes.reshape(-1, 2).tolist()]
        for h, w in grids:
            if h <= 0 or w <= 0 or h % self.merge or w % self.merge:
                raise ValueError(f"image patch grid {h}x{w} must be positive multiples of {self.merge}")
        return grids

    def image_features(self, rows: torch.Tensor, grids: list[PatchGrid]) -> torch.Tensor:
        """Patch rows `[P, C*p*p]` of images with patch grids `grids` -> projected features `[P / m**2, H]`
        (blocks row-major, images in order), as HF's `get_image_features` gives them."""
        feats = self.vision_tower(rows, grids, self.feature_layers)  # [P, E]
        return self.multi_modal_projector(feats, grids)

    @torch.no_grad()
    def embed_multimodal(self, modality: str, data: dict) -> torch.Tensor:
        """Images of the step -> each image's whole placeholder run `[rows * (cols + 1), H]`, concatenated."""
        if modality != "image":
            raise ValueError(f"{type(self).__name__} supports image inputs, not {modality!r}")
        grids = self.patch_grids(data["image_sizes"])
        feats = self.image_features(data["pixel_values"], grids).to(self.embed_dtype)  # [M, H]
        special = data["special_token_ids"].reshape(-1, 2).to(feats.device)  # [N, 2]: (break, end) ids
        special_embeds = self.language_model.get_input_embeddings(special.reshape(-1)).view(-1, 2, feats.shape[-1])
        runs = []
        merged = [(h // self.merge, w // self.merge) for h, w in grids]
        for i, (image, (rows, cols)) in enumerate(zip(feats.split([r * c for r, c in merged]), merged)):
            brk = special_embeds[i, 0].view(1, 1, -1).expand(rows, 1, -1)  # [rows, 1, H]
            run = torch.cat([image.view(rows, cols, -1), brk], dim=1).reshape(rows * (cols + 1), -1)
            run[-1] = special_embeds[i, 1]  # the last break is [IMG_END]
            runs.append(run)
        return torch.cat(runs, dim=0)  # [sum rows * (cols + 1), H]


register_model("Mistral3ForConditionalGeneration", "vlserve.models.mistral3:Mistral3ForConditionalGeneration")
