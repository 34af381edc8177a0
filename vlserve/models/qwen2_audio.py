"""Qwen2-Audio: our Whisper-style audio encoder (vlserve.encoders, `audio_tower.*` weights) and a linear projector
feeding a Qwen2 decoder with plain 1-D RoPE (vlserve's LlamaDecoderModel over the paged KV cache).

Flow per step (the runner drives it):
  1. `embed_multimodal("audio", data)` once for every clip the scheduler released (their mel frames concatenated)
     -> embeddings `[sum of lengths, H]`, split per clip and cached by mm_hash.
  2. `get_input_embeddings(input_ids [T])` -> `[T, H]`; the runner writes clip embeddings over `<|AUDIO|>` rows.
  3. `forward(None, positions [T], kv_caches, attn_metadata, inputs_embeds)` -> hidden `[T, H]`;
     `compute_logits(hidden [N, H])` -> `[N, V]` float32.

T = tokens in the step, H = LLM hidden size, V = vocab size, M = mel bins.
"""

from __future__ import annotations

import torch
from torch import nn

from vlserve.encoders import Qwen2AudioEncoder, qwen2_audio_encoder_config
from vlserve.kernels.packed_linear import PackableLinear
from vlserve.models.capabilities import DECODER_LORA_TARGETS, ModelCapabilities
from vlserve.models.mm_wrapper import MultiModalLM
from vlserve.models.registry import register_model

# checkpoint prefix -> part; transformers 5.x nests everything under `model.`, 4.57 does not.
_PREFIXES = (
    ("model.audio_tower.", "audio_tower"),
    ("audio_tower.", "audio_tower"),
    ("model.multi_modal_projector.", "multi_modal_projector"),
    ("multi_modal_projector.", "multi_modal_projector"),
    ("model.language_model.", "language_model"),
    ("language_model.model.", "language_model"),
)


class Qwen2AudioProjector(nn.Module):
    """Encoder width -> LLM hidden size (HF's `multi_modal_projector.linear`)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.linear = PackableLinear(in_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)  # [N, E] -> [N, H]


class Qwen2AudioForConditionalGeneration(MultiModalLM):
    """Qwen2-Audio: `audio_tower` + `multi_modal_projector` + `language_model` (Qwen2 decoder) + `lm_head`.

    Loads both checkpoint layouts: transformers 4.57's (`audio_tower.*`, `multi_modal_projector.*`,
    `language_model.model.*`, `language_model.lm_head.weight`) and 5.x's (`model.audio_tower.*`,
    `model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.weight`).
    """

    capabilities = ModelCapabilities(
        modalities=("audio",),
        tensor_parallel=True,
        lora_targets=DECODER_LORA_TARGETS,
        encoder_lora=True,
        mm_encoder_only=True,
    )
    weight_prefixes = _PREFIXES
    copied_parts = ("audio_tower", "multi_modal_projector")

    def __init__(self, config) -> None:
        super().__init__(config)
        self.audio_tower = Qwen2AudioEncoder(qwen2_audio_encoder_config(config.audio_config))
        self.multi_modal_projector = Qwen2AudioProjector(
            int(config.audio_config.d_model), int(self.text_config.hidden_size)
        )
        self.build_language_model(qkv_bias=True, o_bias=False)
        self.audio_token_id = int(getattr(config, "audio_token_id", None) or config.audio_token_index)

    # ---- multimodal ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def embed_multimodal(self, modality: str, data: dict) -> torch.Tensor:
        """Encode one or more processed clips -> `[num_embeds, H]`.

        data = {"input_features": [sum F_i, M] (each clip's mel frames, time-major, concatenated),
                "feature_frames": int64 [N] (F_i, frames stored per clip), "valid_frames": int64 [N] (real frames)};
        num_embeds = sum of vlserve.encoders.qwen2_audio_encoder.audio_output_tokens(valid_frames[i]).
        """
        if modality != "audio":
            raise ValueError(f"{type(self).__name__} supports audio inputs, not {modality!r}")
        weight = self.audio_tower.conv1.param
        feats = data["input_features"].to(device=weight.device, dtype=weight.dtype)  # [sum F_i, M]
        stored = torch.as_tensor(data["feature_frames"]).reshape(-1).tolist()
        valid = torch.as_tensor(data["valid_frames"]).reshape(-1).tolist()
        mels = [m.transpose(0, 1) for m in torch.split(feats, stored, dim=0)]  # each [M, F_i]
        states = self.audio_tower(mels, valid)  # [N_embeds, E]
        return self.multi_modal_projector(states).to(self.embed_dtype)  # [N, H]


register_model("Qwen2AudioForConditionalGeneration", "vlserve.models.qwen2_audio:Qwen2AudioForConditionalGeneration")
