"""Qwen3-VL (dense): our vision tower (vlserve.encoders.Qwen3VisionTower, `visual.*` weights) feeding a Qwen3
decoder (per-head q/k RMSNorm) with interleaved M-RoPE and DeepStack.

DeepStack: the tower also projects the output of K of its blocks; those K features of each image token are added
to the output of decoder layers 0..K-1 at that token. They travel with the image embeddings: `embed_multimodal`
returns `[n, H * (1 + K)]` (main embedding, then the K features), the encoder cache keeps them so, and
`get_input_embeddings` returns `[T, H * (1 + K)]` rows (text rows zero past H) for the runner to write item rows
over. `forward` splits them again. Videos arrive one frame per item (`vlserve.multimodal.qwen3_vl_video`), each
with grid (1, h, w); positions are Qwen2-VL's rules on those grids (`vlserve.multimodal.mrope`).

T = tokens in the step, H = LLM hidden size, K = DeepStack levels.
"""

from __future__ import annotations

import torch
from torch import nn

from vlserve.encoders.qwen3_vl_vision import Qwen3VisionTower, qwen3_vl_tower_config
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.models.capabilities import DECODER_LORA_TARGETS, ModelCapabilities
from vlserve.models.moe import SparseMoeBlock, is_sparse_layer
from vlserve.models.qwen2_vl import Qwen2VLForConditionalGeneration
from vlserve.models.registry import register_model


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen3-VL: `visual` (Qwen3VisionTower) + `language_model` (Qwen3 decoder, interleaved M-RoPE, DeepStack) +
    `lm_head`; loads the `model.visual.*` / `model.language_model.*` / `lm_head.weight` layout."""

    @staticmethod
    def _build_vision_tower(vision_config) -> nn.Module:
        return Qwen3VisionTower(qwen3_vl_tower_config(vision_config))

    decoder_kwargs: dict = {"qk_norm": True}  # dense FFNs; Qwen3-VL-MoE adds an mlp_factory
    staged_tower = False  # its tower (DeepStack taps between blocks) runs in one piece
    capabilities = ModelCapabilities(
        modalities=("image", "video"),
        mrope=True,
        tensor_parallel=True,
        lora_targets=DECODER_LORA_TARGETS,
        encoder_lora=True,
        mm_encoder_only=True,
        pipeline_parallel_refusal=(
            "its DeepStack features, added to the first decoder layers' outputs, would have to cross pipeline stages"
        ),
    )

    def __init__(self, config) -> None:
        super().__init__(config)
        self.language_model.rotary_emb.mrope_interleaved = True  # Qwen3-VL's layout, whatever the config says
        if self.visual.num_deepstack_levels > self.language_model.num_layers:
            raise ValueError(
                f"{self.visual.num_deepstack_levels} DeepStack levels but only "
                f"{self.language_model.num_layers} decoder layers"
            )

    @property
    def mm_embed_width(self) -> int:
        """Width of one item embedding row: H * (1 + K)."""
        return self.text_config.hidden_size * (1 + self.visual.num_deepstack_levels)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids [T]` -> `[T, H * (1 + K)]`: token embeddings, then zeros where DeepStack features go."""
        embeds = self.language_model.get_input_embeddings(input_ids)  # [T, H]
        out = embeds.new_zeros(embeds.shape[0], self.mm_embed_width)
        out[:, : embeds.shape[1]] = embeds
        return out

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As the other models; `inputs_embeds`, when given, is `[T, H * (1 + K)]` (see get_input_embeddings)."""
        additions = None
        if inputs_embeds is not None and inputs_embeds.shape[1] != self.text_config.hidden_size:
            parts = inputs_embeds.split(self.text_config.hidden_size, dim=1)  # 1 + K of [T, H]
            inputs_embeds, additions = parts[0], list(parts[1:])
        return self.language_model(
            input_ids, positions, kv_caches, attn_metadata, inputs_embeds, layer_additions=additions
        )


def _moe_or_dense(config, layer_idx: int) -> nn.Module | None:
    return SparseMoeBlock(config) if is_sparse_layer(config, layer_idx) else None


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL-MoE: Qwen3-VL with sparse MoE blocks (vlserve.models.moe: top-k routing, fused experts, expert
    parallelism over the tensor-parallel ranks) in the layers `decoder_sparse_step` / `mlp_only_layers` pick."""

    decoder_kwargs = {"qk_norm": True, "mlp_factory": _moe_or_dense}
    capabilities = Qwen3VLForConditionalGeneration.capabilities  # LoRA: attention only in the MoE layers


register_model("Qwen3VLForConditionalGeneration", "vlserve.models.qwen3_vl:Qwen3VLForConditionalGeneration")
register_model("Qwen3VLMoeForConditionalGeneration", "vlserve.models.qwen3_vl:Qwen3VLMoeForConditionalGeneration")
