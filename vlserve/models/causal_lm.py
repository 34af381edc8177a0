"""Causal LMs over the Llama-family decoder (vlserve.models.llama): `DecoderWithLMHead` (a decoder + `lm_head`,
tying and the calls the runner makes, shared with the multimodal models) and the text-only Llama / Mistral, Qwen2
and Qwen3 causal LMs, which load a HF checkpoint's `model.*` and `lm_head.weight`.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from vlserve.distributed.parallel_state import tp_size
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.models.hf_config import tie_word_embeddings_of
from vlserve.models.llama import IGNORED_SUFFIXES, LlamaDecoderModel
from vlserve.models.parallel_layers import ParallelLMHead, ShardSpec


class DecoderWithLMHead(nn.Module):
    """A LlamaDecoderModel (at attribute `decoder_attr`) + `lm_head`: tying and the calls the runner makes.

    Subclasses build the decoder and `lm_head` themselves, then call `tie_weights()`.
    """

    decoder_attr = "model"

    @property
    def decoder(self) -> "LlamaDecoderModel":
        """The LlamaDecoderModel."""
        return getattr(self, self.decoder_attr)

    @property
    def tied(self) -> bool:
        """Whether lm_head shares the input embedding matrix."""
        return tie_word_embeddings_of(self.config)

    def tie_weights(self) -> None:
        """Point lm_head at the embedding matrix when the config ties them (re-run after materializing)."""
        if self.tied:
            self.lm_head.weight = self.decoder.embed_tokens.weight

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids [T]` -> token embeddings `[T, H]` (a VLM's runner writes item embeddings over placeholders)."""
        return self.decoder.get_input_embeddings(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attn_metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Flattened step -> hidden states `[T, H]`; positions `[T]`, or `[3, T]` under M-RoPE (see
        `LlamaDecoderModel.forward`)."""
        return self.decoder(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden [N, H]` -> logits `[N, V]` float32 (every tensor-parallel rank gets the whole vocab)."""
        return self.lm_head(hidden).float()

    def _split_name(self, name: str) -> tuple[str, str]:
        """Checkpoint name -> (part, name relative to it): `model.*` -> the decoder, `lm_head.weight` -> lm_head;
        part "" for other names."""
        if name == "lm_head.weight":
            return "lm_head", "weight"
        if name.startswith("model."):
            return self.decoder_attr, name[len("model."):]
        return "", name

    def checkpoint_shard(self, name: str) -> ShardSpec | None:
        """`(dim, start, length)` of checkpoint tensor `name` that this tensor-parallel rank reads, or None to read
        it whole: decoder tensors and lm_head are sharded, every other part (encoders, projectors) replicated."""
        if tp_size() == 1:
            return None
        part, rel = self._split_name(name)
        if part == self.decoder_attr:
            return self.decoder.checkpoint_shard(rel)
        if part == "lm_head":
            return self.lm_head.checkpoint_shard("weight")
        return None


class LlamaForCausalLM(DecoderWithLMHead):
    """Llama causal LM: `model` (LlamaDecoderModel) + `lm_head` (tied to embeddings if `tie_word_embeddings`)."""

    # The decoder class and its keyword arguments; subclasses override.
    decoder_cls, decoder_kwargs = LlamaDecoderModel, {}

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = self.decoder_cls(config, **self.decoder_kwargs)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        self.tie_weights()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a full HF checkpoint (`model.*`, `lm_head.weight`); ValueError lists missing/unexpected names."""
        loaded: set[str] = set()
        unexpected: list[str] = []

        def decoder_weights():
            for name, tensor in weights:
                if name.startswith("model."):
                    yield name[len("model."):], tensor
                elif name == "lm_head.weight":
                    if not self.tied:
                        self.lm_head.load_shard("weight", None, tensor, name)
                        loaded.add(name)
                elif not name.endswith(IGNORED_SUFFIXES):
                    unexpected.append(name)

        loaded.update("model." + n for n in self.model.load_weights(decoder_weights()))
        expected = {"model." + n for n in self.model.expected_weight_names()}
        if not self.tied:
            expected.add("lm_head.weight")
        missing = sorted(expected - loaded)
        if unexpected:
            raise ValueError(f"unexpected weights in checkpoint: {unexpected[:10]}")
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:10]}")


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on q/k/v (none on o_proj)."""

    decoder_kwargs = {"qkv_bias": True, "o_bias": False}


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head RMSNorm on q and k before RoPE; biases follow `config.attention_bias`."""

    decoder_kwargs = {"qk_norm": True}
