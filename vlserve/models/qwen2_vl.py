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

from typing import Iterable

import torch
from torch import nn

from vlserve.encoders import Qwen2_5VisionTower, Qwen2VisionTower, qwen2_5_vl_tower_config, qwen2_vl_tower_config
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.models.llama import LlamaDecoderModel
from vlserve.models.registry import register_model

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_pos_emb.inv_freq")


class Qwen2VLForConditionalGeneration(nn.Module):
    """Qwen2-VL: `visual` (vlserve.encoders.Qwen2VisionTower) + `language_model` (Qwen2 decoder, M-RoPE) +
    `lm_head`.

    Loads both checkpoint layouts: the one transformers 4.57 save_pretrained writes (`visual.*`, `model.*`,
    `lm_head.weight`) and the newer module layout (`model.visual.*`, `model.language_model.*`, `lm_head.weight`).
    """

    supports_multimodal = True
    uses_mrope = True
    supported_modalities = ("image", "video")

    @staticmethod
    def _build_vision_tower(vision_config) -> nn.Module:
        return Qwen2VisionTower(qwen2_vl_tower_config(vision_config))

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.text_config = getattr(config, "text_config", config)
        self.visual = self._build_vision_tower(config.vision_config)
        self.language_model = LlamaDecoderModel(self.text_config, qkv_bias=True, o_bias=False)
        self.lm_head = nn.Linear(self.text_config.hidden_size, self.text_config.vocab_size, bias=False)
        self.image_token_id = config.image_token_id
        self.video_token_id = config.video_token_id
        self.tie_weights()

    @property
    def tied(self) -> bool:
        """Whether lm_head shares the input embedding matrix."""
        return bool(getattr(self.text_config, "tie_word_embeddings", False))

    def tie_weights(self) -> None:
        """Point lm_head at the embedding matrix when the config ties them (re-run after materializing)."""
        if self.tied:
            self.lm_head.weight = self.language_model.embed_tokens.weight

    # ---- multimodal ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def embed_multimodal(self, modality: str, data: dict) -> torch.Tensor:
        """Run the vision tower once on one or more processed items (pixel rows and grids concatenated in item
        order) -> `[num_embeds, H]`.

        image: data = {"pixel_values": [P, C*tp*p*p], "image_grid_thw": [N, 3]};
        video: data = {"pixel_values_videos": [P, C*tp*p*p], "video_grid_thw": [N, 3], ...};
        num_embeds = sum(grid_t * grid_h * grid_w) // spatial_merge_size**2 (N items concatenated in order).
        """
        if modality == "image":
            pixels, grid = data["pixel_values"], data["image_grid_thw"]
        elif modality == "video":
            pixels, grid = data["pixel_values_videos"], data["video_grid_thw"]
        else:
            raise ValueError(f"{type(self).__name__} supports image and video inputs, not {modality!r}")
        param = self.visual.patch_embed.proj.weight
        grid = torch.as_tensor(grid, dtype=torch.long).reshape(-1, 3).tolist()  # N rows of (t, h, w)
        pixels = pixels.to(device=param.device, dtype=param.dtype)  # [P, C*tp*p*p]
        embeds = self.visual(pixels, grid)  # [P // merge**2, H]
        return embeds.to(self.language_model.embed_tokens.weight.dtype)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings `input_ids [T]` -> `[T, H]` (the runner writes item embeddings over the placeholders
        with `vlserve.multimodal.embeds.merge_mm_embeds`)."""
        return self.language_model.get_input_embeddings(input_ids)  # [T, H]

    def get_mrope_input_positions(self, prompt_token_ids: list[int], mm_features: list) -> tuple[torch.Tensor, int]:
        """`(positions [3, L] int64, mrope_position_delta)` of a whole prompt (see vlserve.multimodal.mrope)."""
        from vlserve.multimodal.mrope import get_mrope_positions
        return get_mrope_positions(prompt_token_ids, mm_features, self.config)

    # ---- language model ------------------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attn_metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Flattened step -> final hidden states `[T, H]`; positions `[3, T]` (M-RoPE) or `[T]` (text only)."""
        return self.language_model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden [N, H]` -> logits `[N, V]` float32."""
        return self.lm_head(hidden).float()

    # ---- weights -------------------------------------------------------------------------------------------------

    @staticmethod
    def _split_name(name: str) -> tuple[str, str]:
        """Checkpoint name -> ("visual" | "language_model" | "lm_head" | "", name relative to that part)."""
        for prefix, part in (("model.visual.", "visual"), ("visual.", "visual"),
                             ("model.language_model.", "language_model"), ("language_model.model.", "language_model"),
                             ("model.", "language_model")):
            if name.startswith(prefix):
                return part, name[len(prefix):]
        if name in ("lm_head.weight", "language_model.lm_head.weight"):
            return "lm_head", "weight"
        return "", name

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a full HF checkpoint (either layout); ValueError lists missing/unexpected/mis-shaped names."""
        vis_params = dict(self.visual.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []

        def decoder_weights():
            for name, tensor in weights:
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                part, rel = self._split_name(name)
                if part == "language_model":
                    yield rel, tensor
                elif part == "visual":
                    if rel not in vis_params:
                        unexpected.append(name)
                        continue
                    dst = vis_params[rel].data
                    if tuple(dst.shape) != tuple(tensor.shape):
                        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                         f"expected {tuple(dst.shape)}")
                    dst.copy_(tensor)
                    loaded.add("visual." + rel)
                elif part == "lm_head":
                    if not self.tied:
                        if tuple(tensor.shape) != tuple(self.lm_head.weight.shape):
                            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                             f"expected {tuple(self.lm_head.weight.shape)}")
                        self.lm_head.weight.data.copy_(tensor)
                        loaded.add("lm_head.weight")
                else:
                    unexpected.append(name)

        loaded.update("language_model." + n for n in self.language_model.load_weights(decoder_weights()))
        expected = {"language_model." + n for n in self.language_model.expected_weight_names()}
        expected.update("visual." + n for n in vis_params)
        if not self.tied:
            expected.add("lm_head.weight")
        if unexpected:
            raise ValueError(f"unexpected weights in checkpoint: {unexpected[:10]}")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:10]}")


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: same structure; the vision tower (RMSNorm, SwiGLU, windowed attention with full-attention blocks
    at `fullatt_block_indexes`) is vlserve.encoders.Qwen2_5VisionTower. Video temporal positions scale with
    second_per_grid_ts * tokens_per_second (handled in vlserve.multimodal.mrope)."""

    @staticmethod
    def _build_vision_tower(vision_config) -> nn.Module:
        return Qwen2_5VisionTower(qwen2_5_vl_tower_config(vision_config))


register_model("Qwen2VLForConditionalGeneration", "vlserve.models.qwen2_vl:Qwen2VLForConditionalGeneration")
register_model("Qwen2_5_VLForConditionalGeneration", "vlserve.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration")
