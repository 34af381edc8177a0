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

from typing import Iterable

import torch
from torch import nn

from vlserve.encoders import Qwen2AudioEncoder, qwen2_audio_encoder_config
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.models.llama import LlamaDecoderModel
from vlserve.models.registry import register_model

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# checkpoint prefix -> part; transformers 5.x nests everything under `model.`, 4.57 does not.
_PREFIXES = (("model.audio_tower.", "audio_tower"), ("audio_tower.", "audio_tower"),
             ("model.multi_modal_projector.", "multi_modal_projector"),
             ("multi_modal_projector.", "multi_modal_projector"),
             ("model.language_model.", "language_model"), ("language_model.model.", "language_model"))


class Qwen2AudioProjector(nn.Module):
    """Encoder width -> LLM hidden size (HF's `multi_modal_projector.linear`)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.linear = nn.Linear(in_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)  # [N, E] -> [N, H]


class Qwen2AudioForConditionalGeneration(nn.Module):
    """Qwen2-Audio: `audio_tower` + `multi_modal_projector` + `language_model` (Qwen2 decoder) + `lm_head`.

    Loads both checkpoint layouts: transformers 4.57's (`audio_tower.*`, `multi_modal_projector.*`,
    `language_model.model.*`, `language_model.lm_head.weight`) and 5.x's (`model.audio_tower.*`,
    `model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.weight`).
    """

    supports_multimodal = True
    uses_mrope = False
    supported_modalities = ("audio",)

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.text_config = config.text_config
        self.audio_tower = Qwen2AudioEncoder(qwen2_audio_encoder_config(config.audio_config))
        self.multi_modal_projector = Qwen2AudioProjector(int(config.audio_config.d_model),
                                                         int(self.text_config.hidden_size))
        self.language_model = LlamaDecoderModel(self.text_config, qkv_bias=True, o_bias=False)
        self.lm_head = nn.Linear(self.text_config.hidden_size, self.text_config.vocab_size, bias=False)
        self.audio_token_id = int(getattr(config, "audio_token_id", None) or config.audio_token_index)
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
        """Encode one or more processed clips -> `[num_embeds, H]`.

        data = {"input_features": [sum F_i, M] (each clip's mel frames, time-major, concatenated),
                "feature_frames": int64 [N] (F_i, frames stored per clip), "valid_frames": int64 [N] (real frames)};
        num_embeds = sum of vlserve.encoders.qwen2_audio_encoder.audio_output_tokens(valid_frames[i]).
        """
        if modality != "audio":
            raise ValueError(f"{type(self).__name__} supports audio inputs, not {modality!r}")
        weight = self.audio_tower.conv1.weight
        feats = data["input_features"].to(device=weight.device, dtype=weight.dtype)  # [sum F_i, M]
        stored = torch.as_tensor(data["feature_frames"]).reshape(-1).tolist()
        valid = torch.as_tensor(data["valid_frames"]).reshape(-1).tolist()
        mels = [m.transpose(0, 1) for m in torch.split(feats, stored, dim=0)]  # each [M, F_i]
        states = self.audio_tower(mels, valid)  # [N_embeds, E]
        return self.multi_modal_projector(states).to(self.language_model.embed_tokens.weight.dtype)  # [N, H]

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings `input_ids [T]` -> `[T, H]`."""
        return self.language_model.get_input_embeddings(input_ids)  # [T, H]

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
        """Checkpoint name -> (part, name relative to that part); part "" for names that belong nowhere."""
        for prefix, part in _PREFIXES:
            if name.startswith(prefix):
                return part, name[len(prefix):]
        if name in ("lm_head.weight", "language_model.lm_head.weight"):
            return "lm_head", "weight"
        return "", name

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a full HF checkpoint (either layout); ValueError lists missing/unexpected/mis-shaped names."""
        own = {"audio_tower": dict(self.audio_tower.named_parameters()),
               "multi_modal_projector": dict(self.multi_modal_projector.named_parameters())}
        loaded: set[str] = set()
        unexpected: list[str] = []

        def copy(name: str, dst: torch.Tensor, tensor: torch.Tensor) -> None:
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)

        def decoder_weights():
            for name, tensor in weights:
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                part, rel = self._split_name(name)
                if part == "language_model":
                    yield rel, tensor
                elif part in own:
                    if rel not in own[part]:
                        unexpected.append(name)
                        continue
                    copy(name, own[part][rel].data, tensor)
                    loaded.add(f"{part}.{rel}")
                elif part == "lm_head":
                    if not self.tied:
                        copy(name, self.lm_head.weight.data, tensor)
                        loaded.add("lm_head.weight")
                else:
                    unexpected.append(name)

        loaded.update("language_model." + n for n in self.language_model.load_weights(decoder_weights()))
        expected = {"language_model." + n for n in self.language_model.expected_weight_names()}
        expected.update(f"{part}.{n}" for part, params in own.items() for n in params)
        if not self.tied:
            expected.add("lm_head.weight")
        if unexpected:
            raise ValueError(f"unexpected weights in checkpoint: {unexpected[:10]}")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:10]}")


register_model("Qwen2AudioForConditionalGeneration",
               "vlserve.models.qwen2_audio:Qwen2AudioForConditionalGeneration")
