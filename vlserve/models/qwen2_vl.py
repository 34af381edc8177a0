"""Qwen2-VL and Qwen2.5-VL: our vision tower (vlserve.encoders, `visual.*` weights) feeding a Qwen2 decoder
with M-RoPE (vlserve's LlamaDecoderModel over the paged KV cache).

Flow per step (the runner drives it):
  1. `embed_multimodal(modality, data)` once per modality for every item the scheduler released (their pixel rows
     and grids concatenated) -> embeddings `[sum of lengths, H]`, split per item and cached by mm_hash.
  2. `get_input_embeddings(input_ids [T])` -> `[T, H]` token embeddings; the runner writes (slices of) item
     embeddings over the placeholder rows (`vlserve.multimodal.embeds`).
  3. `forward(None, positions [3, T], kv_caches, attn_metadata, inputs_embeds)` -> hidden `[T, H]`;
     `compute_logits(hidden [N, H])` -> `[N, V]` float32.
Positions come from `vlserve.multimodal.mrope` (`get_mrope_input_positions` below is a shortcut).

T = tokens in the step, H = LLM hidden size, V = vocab size.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from vlserve.encoders import Qwen2_5VisionTower, Qwen2VisionTower, qwen2_5_vl_tower_config, qwen2_vl_tower_config
from vlserve.encoders.staged import TowerState
from vlserve.models.capabilities import DECODER_LORA_TARGETS, ModelCapabilities
from vlserve.models.mm_wrapper import MultiModalLM
from vlserve.models.registry import register_model


class Qwen2VLForConditionalGeneration(MultiModalLM):
    """Qwen2-VL: `visual` (vlserve.encoders.Qwen2VisionTower) + `language_model` (Qwen2 decoder, M-RoPE) +
    `lm_head`.

    Loads both checkpoint layouts: the one transformers 4.57 save_pretrained writes (`visual.*`, `model.*`,
    `lm_head.weight`) and the newer module layout (`model.visual.*`, `model.language_model.*`, `lm_head.weight`).
    """

    # over pipeline stages: the tower on the first stage; every stage computes the M-RoPE positions
    capabilities = ModelCapabilities(
        modalities=("image", "video"),
        mrope=True,
        pipeline_parallel=True,
        tensor_parallel=True,
        lora_targets=DECODER_LORA_TARGETS,
        encoder_lora=True,
        mm_encoder_only=True,
    )
    weight_prefixes = (
        ("model.visual.", "visual"),
        ("visual.", "visual"),
        ("model.language_model.", "language_model"),
        ("language_model.model.", "language_model"),
        ("model.", "language_model"),
    )
    copied_parts = ("visual",)
    ignored_suffixes = ("rotary_emb.inv_freq", "rotary_pos_emb.inv_freq")

    @staticmethod
    def _build_vision_tower(vision_config) -> nn.Module:
        return Qwen2VisionTower(qwen2_vl_tower_config(vision_config))

    decoder_kwargs: dict = {"qkv_bias": True, "o_bias": False}  # for LlamaDecoderModel; subclasses override

    def __init__(self, config) -> None:
        super().__init__(config)
        self.visual = self._build_vision_tower(config.vision_config)
        self.build_language_model(**self.decoder_kwargs)

    # ---- multimodal ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def embed_multimodal(self, modality: str, data: dict) -> torch.Tensor:
        """Run the vision tower once on one or more processed items (pixel rows and grids concatenated in item
        order) -> `[num_embeds, H]`.

        image: data = {"pixel_values": [P, C*tp*p*p], "image_grid_thw": [N, 3]};
        video: data = {"pixel_values_videos": [P, C*tp*p*p], "video_grid_thw": [N, 3], ...};
        num_embeds = sum(grid_t * grid_h * grid_w) // spatial_merge_size**2 (N items concatenated in order).
        """
        pixels, grid = self._tower_inputs(modality, data)
        embeds = self.visual(pixels, grid)  # [P // merge**2, H]
        return embeds.to(self.embed_dtype)

    # Staged encoding (vlserve.encoders.staged): one large item over several steps, a slice of the tower's blocks
    # per step. The same math as `embed_multimodal`, cut between blocks. Qwen3-VL's tower runs in one piece.
    staged_tower = True

    @classmethod
    def capabilities_for(cls, hf_config) -> ModelCapabilities:
        """As every family's, and with `staged_tower` an item's encoding stages: the tower's blocks."""
        caps = super().capabilities_for(hf_config)
        if not cls.staged_tower:
            return caps
        depth = hf_config.vision_config.depth
        return replace(caps, encoder_stage_counts={"image": depth, "video": depth})

    @torch.no_grad()
    def begin_encode_stages(self, modality: str, data: dict) -> TowerState:
        """An item's tower state before its first block (data as `embed_multimodal`'s)."""
        pixels, grid = self._tower_inputs(modality, data)
        return self.visual.begin_stages(pixels, grid)

    @torch.no_grad()
    def run_encode_stages(self, state: TowerState, start: int, end: int) -> TowerState:
        """Run the tower's blocks [start, end) on the carried state."""
        return self.visual.run_stages(state, start, end)

    @torch.no_grad()
    def finish_encode_stages(self, state: TowerState) -> torch.Tensor:
        """The merger after the last block -> `[num_embeds, H]` (as `embed_multimodal` returns)."""
        return self.visual.finish_stages(state).to(self.embed_dtype)

    def _tower_inputs(self, modality: str, data: dict) -> tuple[torch.Tensor, list[list[int]]]:
        """Processed data -> (`pixels [P, C*tp*p*p]` on the tower's device and dtype, N rows of (t, h, w))."""
        if modality == "image":
            pixels, grid = data["pixel_values"], data["image_grid_thw"]
        elif modality == "video":
            pixels, grid = data["pixel_values_videos"], data["video_grid_thw"]
        else:
            raise ValueError(f"{type(self).__name__} supports image and video inputs, not {modality!r}")
        param = self.visual.patch_embed.proj.param
        grid = torch.as_tensor(grid, dtype=torch.long).reshape(-1, 3).tolist()  # N rows of (t, h, w)
        return pixels.to(device=param.device, dtype=param.dtype), grid

    def get_mrope_input_positions(self, prompt_token_ids: list[int], mm_features: list) -> tuple[torch.Tensor, int]:
        """`(positions [3, L] int64, mrope_position_delta)` of a whole prompt (see vlserve.multimodal.mrope)."""
        from vlserve.multimodal.mrope import get_mrope_positions

        return get_mrope_positions(prompt_token_ids, mm_features, self.config)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: same structure; the vision tower (RMSNorm, SwiGLU, windowed attention with full-attention blocks
    at `fullatt_block_indexes`) is vlserve.encoders.Qwen2_5VisionTower. Video temporal positions scale with
    second_per_grid_ts * tokens_per_second (handled in vlserve.multimodal.mrope)."""

    capabilities = Qwen2VLForConditionalGeneration.capabilities

    @staticmethod
    def _build_vision_tower(vision_config) -> nn.Module:
        return Qwen2_5VisionTower(qwen2_5_vl_tower_config(vision_config))


register_model("Qwen2VLForConditionalGeneration", "vlserve.models.qwen2_vl:Qwen2VLForConditionalGeneration")
register_model("Qwen2_5_VLForConditionalGeneration", "vlserve.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration")
