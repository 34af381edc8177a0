"""Gemma 3 vision-language model (`Gemma3ForConditionalGeneration`): a SigLIP vision tower read at its
`last_hidden_state` (post_layernorm applied), a projector that average-pools the square patch grid down to
sqrt(mm_tokens_per_image) tokens per side, normalizes them with Gemma's RMSNorm (`mm_soft_emb_norm`) and multiplies
by `mm_input_projection_weight` [E, H], and Gemma 3's text decoder (vlserve.models.gemma3) with the tied lm_head.
The logits are NOT soft-capped: HF's Gemma3ForConditionalGeneration (4.57 and 5.x) ignores the text config's
`final_logit_softcapping` (only its text-only Gemma3ForCausalLM applies it), and vlserve matches HF.

Prompts (vlserve.multimodal.gemma3_items): each image, and with pan-and-scan each of its crops, is
`<start_of_image>` + mm_tokens_per_image x `<image_soft_token>` + `<end_of_image>`; one item = one such crop, its
embeddings cover the soft tokens only. The soft tokens take the projected features as they are: HF scales the token
embeddings by sqrt(H), then writes the image features over them unscaled. The soft tokens of one crop attend to each
other in both directions in prefill; the model runner builds those key limits from `bidirectional_token_id`, and
the scheduler keeps a crop's run in one step (`unsplit_mm_items`).

Flow per step (the runner drives it):
  1. `embed_multimodal("image", {"pixel_values": [N, C, S, S]})` (N crops of the step) -> `[N * mm_tokens, H]`.
  2. `get_input_embeddings(input_ids [T])` -> scaled token embeddings `[T, H]`; the runner writes item embeddings
     over the soft tokens.
  3. `forward(None, positions [T], kv_caches, attn_metadata, inputs_embeds)` -> hidden `[T, H]`;
     `compute_logits(hidden [N, H])` -> `[N, V]` float32.
T = tokens in the step, H = LLM hidden size, V = vocab size, E = tower width, P = patches per image.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from vlserve.encoders.clip_vision import VitConfig
from vlserve.encoders.siglip_vision import SiglipVisionTower
from vlserve.models.capabilities import DECODER_LORA_TARGETS, ModelCapabilities
from vlserve.models.gemma3 import Gemma3TextDecoderModel, GemmaRMSNorm
from vlserve.models.hf_config import token_id_of
from vlserve.models.mm_wrapper import MultiModalLM, image_token_of
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


class Gemma3Projector(nn.Module):
    """avg-pool the patch grid (side g) to side t = sqrt(tokens), Gemma RMSNorm, times `mm_input_projection_weight`:
    `[N, g*g, E]` -> `[N, t*t, H]` (pooled tokens row-major)."""

    def __init__(self, width: int, out_dim: int, grid: int, tokens: int, eps: float) -> None:
        super().__init__()
        side = math.isqrt(tokens)
        if side * side != tokens or grid % side:
            raise ValueError(
                f"mm_tokens_per_image={tokens} must be a square whose side divides the {grid}x{grid} patch grid"
            )
        self.grid, self.side, self.kernel = grid, side, grid // side
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(width, out_dim))
        self.mm_soft_emb_norm = GemmaRMSNorm(width, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, e = x.shape
        t, k = self.side, self.kernel
        grid = x.view(n, t, k, t, k, e)  # [N, t, k, t, k, E]: patch row = i * k + a, column = j * k + b
        pooled = grid.mean(dim=(2, 4)).reshape(n, t * t, e)  # [N, t*t, E]
        normed = self.mm_soft_emb_norm(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight.to(normed.dtype)).to(x.dtype)  # [N, t*t, H]


class Gemma3ForConditionalGeneration(MultiModalLM):
    """Gemma 3 VLM: `vision_tower` (SigLIP) + `multi_modal_projector` + `language_model` (Gemma3TextDecoderModel) +
    tied `lm_head`; loads 5.x's layout (`model.vision_tower.*`, `model.multi_modal_projector.*`,
    `model.language_model.*`) and 4.57's top-level names."""

    # unsplit items: the scheduler keeps each crop's soft-token run inside one step
    capabilities = ModelCapabilities(
        modalities=("image",),
        unsplit_mm_items=True,
        tensor_parallel=True,
        lora_targets=DECODER_LORA_TARGETS,
        encoder_lora=True,
        mm_encoder_only=True,
        pipeline_parallel_refusal=(
            "the Gemma 3 decoder (scaled embeddings, per-layer-type RoPE, bidirectional "
            "image runs) has not been split over pipeline stages"
        ),
    )
    weight_prefixes = _PREFIXES
    copied_parts = ("multi_modal_projector",)
    delegated_parts = ("vision_tower",)
    decoder_cls = Gemma3TextDecoderModel

    @classmethod
    def capabilities_for(cls, hf_config) -> ModelCapabilities:
        """The prompt's placeholder is `<start_of_image>`, before expansion; the soft tokens it expands to attend
        both ways, one run per crop. ValueError for a config without either token."""
        soft = image_token_of(hf_config)
        boi = token_id_of(hf_config, "boi_token_id")
        boi = boi if boi is not None else token_id_of(hf_config, "boi_token_index")
        if soft is None or boi is None:
            raise ValueError("Gemma 3 config needs image_token_index and boi_token_index")
        return replace(cls.capabilities, image_token_id=int(boi), bidirectional_token_id=int(soft))

    def __init__(self, config) -> None:
        super().__init__(config)
        vision = config.vision_config
        kind = getattr(vision, "model_type", "")
        if kind != "siglip_vision_model":
            raise ValueError(f"Gemma 3 vision tower {str(kind)[:60]!r} is not supported (expected SigLIP)")
        self.vision_tower = SiglipVisionTower(VitConfig.from_hf(vision))
        cfg = self.vision_tower.cfg
        self.mm_tokens_per_image = int(config.mm_tokens_per_image)
        self.multi_modal_projector = Gemma3Projector(
            cfg.width,
            self.text_config.hidden_size,
            cfg.image_size // cfg.patch_size,
            self.mm_tokens_per_image,
            cfg.layer_norm_eps,
        )
        self.build_language_model()
        self.capabilities_for(config)  # ValueError for a config without its image tokens

    # ---- multimodal ------------------------------------------------------------------------------------------------

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """`pixels [N, C, S, S]` -> projected features `[N, mm_tokens, H]` (HF's `get_image_features`)."""
        return self.multi_modal_projector(self.vision_tower.last_hidden_state(pixels))

    @torch.no_grad()
    def embed_multimodal(self, modality: str, data: dict) -> torch.Tensor:
        """Crops of the step, `data["pixel_values"] [N, C, S, S]` -> `[N * mm_tokens, H]` in item order (not
        scaled by sqrt(H), as in HF)."""
        if modality != "image":
            raise ValueError(f"{type(self).__name__} supports image inputs, not {modality!r}")
        feats = self.image_features(data["pixel_values"])  # [N, mm_tokens, H]
        return feats.reshape(-1, feats.shape[-1]).to(self.embed_dtype)


register_model("Gemma3ForConditionalGeneration", "vlserve.models.gemma3_mm:Gemma3ForConditionalGeneration")
