"""Causal LMs over the Llama-family decoder (vlserve.models.llama): `DecoderWithLMHead` (a decoder + `lm_head`,
tying and the calls the runner makes, shared with the multimodal models) and the text-only Llama / Mistral, Qwen2
and Qwen3 causal LMs, which load a HF checkpoint's `model.*` and `lm_head.weight`. The text-only causal LMs split
over pipeline stages (`ModelCapabilities.pipeline_parallel`): `lm_head` lives on the last stage, which reads it
from `model.embed_tokens.weight` when the two are tied and the embeddings are on another stage.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from vlserve.distributed.parallel_state import tp_size
from vlserve.distributed.pipeline import IntermediateTensors, is_last_stage
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.models.capabilities import DECODER_LORA_TARGETS, ModelCapabilities
from vlserve.models.hf_config import tie_word_embeddings_of
from vlserve.models.llama import IGNORED_SUFFIXES, AbsentOnStage, LlamaDecoderModel
from vlserve.models.parallel_layers import ParallelLMHead, ShardSpec


class DecoderWithLMHead(nn.Module):
    """A LlamaDecoderModel (at attribute `decoder_attr`) + `lm_head`: tying and the calls the runner makes.

    Subclasses build the decoder and `lm_head` themselves, then call `tie_weights()`. Every registered class
    states its `capabilities` in its own body (vlserve.models.capabilities).
    """

    decoder_attr = "model"
    capabilities: ClassVar[ModelCapabilities]

    @classmethod
    def capabilities_for(cls, hf_config) -> ModelCapabilities:
        """`capabilities` with the values `hf_config` decides filled in: a text LM's statement as is."""
        return cls.capabilities

    def encoder_parts(self) -> list[nn.Module]:
        """The encoder parts (towers, projectors): none in a text LM."""
        return []

    def keep_stage_parts(self) -> None:
        """Drop what this pipeline stage does not hold before materializing: nothing in a text LM (its decoder
        builds only its stage's layers)."""

    @property
    def decoder(self) -> LlamaDecoderModel:
        """The LlamaDecoderModel."""
        return getattr(self, self.decoder_attr)

    @property
    def tied(self) -> bool:
        """Whether lm_head shares the input embedding matrix."""
        return tie_word_embeddings_of(self.config)

    def tie_weights(self) -> None:
        """Point lm_head at the embedding matrix when the config ties them (re-run after materializing)."""
        if self.tied and not isinstance(self.lm_head, AbsentOnStage) and self.decoder.first_stage:
            self.lm_head.weight = self.decoder.embed_tokens.weight

    def head_reads_embeddings(self) -> bool:
        """Whether this stage's `lm_head` is loaded from the decoder's `embed_tokens.weight`: tied, with the embeddings
        on another pipeline stage (on the same stage the two are one parameter)."""
        return self.tied and not isinstance(self.lm_head, AbsentOnStage) and not self.decoder.first_stage

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids [T]` -> token embeddings `[T, H]` (a VLM's runner writes item embeddings over placeholders)."""
        return self.decoder.get_input_embeddings(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Flattened step -> hidden states `[T, H]`; positions `[T]`, or `[3, T]` under M-RoPE (see
        `LlamaDecoderModel.forward`, also for the pipeline stages' `intermediate`)."""
        if intermediate is None:
            return self.decoder(input_ids, positions, kv_caches, attn_metadata, inputs_embeds)
        return self.decoder(input_ids, positions, kv_caches, attn_metadata, inputs_embeds, intermediate=intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden [N, H]` -> logits `[N, V]` float32 (every tensor-parallel rank gets the whole vocab)."""
        return self.lm_head(hidden).float()

    def _split_name(self, name: str) -> tuple[str, str]:
        """Checkpoint name -> (part, name relative to it): `model.*` -> the decoder, `lm_head.weight` -> lm_head;
        part "" for other names."""
        if name == "lm_head.weight":
            return "lm_head", "weight"
        if name.startswith("model."):
            return self.decoder_attr, name[len("model.") :]
        return "", name

    def checkpoint_shard(self, name: str) -> ShardSpec | None:
        """`(dim, start, length)` of checkpoint tensor `name` that this tensor-parallel rank reads, or None to read
        it whole: decoder tensors and lm_head are sharded, every other part (encoders, projectors) replicated."""
        if tp_size() == 1:
            return None
        part, rel = self._split_name(name)
        if part == self.decoder_attr:
            if rel == "embed_tokens.weight" and self.head_reads_embeddings():
                return self.lm_head.checkpoint_shard("weight")  # a tied head's rows, on a stage without embeddings
            return self.decoder.checkpoint_shard(rel)
        if part == "lm_head":
            return self.lm_head.checkpoint_shard("weight")
        return None


class LlamaForCausalLM(DecoderWithLMHead):
    """Llama causal LM: `model` (LlamaDecoderModel) + `lm_head` (tied to embeddings if `tie_word_embeddings`)."""

    # The decoder class and its keyword arguments; subclasses override.
    decoder_cls, decoder_kwargs = LlamaDecoderModel, {}
    capabilities = ModelCapabilities(pipeline_parallel=True, tensor_parallel=True, lora_targets=DECODER_LORA_TARGETS)

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = self.decoder_cls(config, **self.decoder_kwargs)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size) if is_last_stage() else AbsentOnStage()
        self.tie_weights()

    def _lm_head_source(self) -> str | None:
        """The checkpoint tensor this stage loads `lm_head` from: None when lm_head is on another stage or is the
        embedding matrix itself (tied, both here)."""
        if isinstance(self.lm_head, AbsentOnStage):
            return None
        if not self.tied:
            return "lm_head.weight"
        return None if self.model.first_stage else "model.embed_tokens.weight"

    def on_other_stage(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to another pipeline stage only (the loader does not read it)."""
        if name == self._lm_head_source():
            return False
        if name == "lm_head.weight":
            return isinstance(self.lm_head, AbsentOnStage)
        return name.startswith("model.") and self.model.on_other_stage(name[len("model.") :])

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a full HF checkpoint (`model.*`, `lm_head.weight`); ValueError lists missing/unexpected names."""
        loaded: set[str] = set()
        unexpected: list[str] = []
        head_source = self._lm_head_source()

        def decoder_weights():
            for name, tensor in weights:
                if name == head_source:
                    self.lm_head.load_shard("weight", None, tensor, name)
                    loaded.add(name)
                elif name.startswith("model."):
                    yield name[len("model.") :], tensor
                elif name == "lm_head.weight":
                    pass  # tied to the embeddings, or on another pipeline stage
                elif not name.endswith(IGNORED_SUFFIXES):
                    unexpected.append(name)

        loaded.update("model." + n for n in self.model.load_weights(decoder_weights()))
        expected = {"model." + n for n in self.model.expected_weight_names()}
        if head_source is not None:
            expected.add(head_source)
        missing = sorted(expected - loaded)
        if unexpected:
            raise ValueError(f"unexpected weights in checkpoint: {unexpected[:10]}")
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:10]}")


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on q/k/v (none on o_proj)."""

    decoder_kwargs = {"qkv_bias": True, "o_bias": False}
    capabilities = LlamaForCausalLM.capabilities


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head RMSNorm on q and k before RoPE; biases follow `config.attention_bias`."""

    decoder_kwargs = {"qk_norm": True}
    capabilities = LlamaForCausalLM.capabilities
