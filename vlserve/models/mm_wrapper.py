"""The part every multimodal model here shares: encoder parts feeding `language_model` (a LlamaDecoderModel over
the paged KV cache) + `lm_head`, and loading a HF checkpoint in either transformers layout.

A family subclasses `MultiModalLM`, builds its encoder parts, then calls `build_language_model(...)`, and says how
checkpoint names map onto its parts (`weight_prefixes`) and how each part loads (`copied_parts`, `delegated_parts`,
`_load_extra`). It keeps `embed_multimodal` (and any positions of its own) in its own file.

Flow per step (the runner drives it):
  1. `embed_multimodal(modality, data)` once per modality for the items the scheduler released -> `[sum of
     lengths, H]`, split per item and cached by mm_hash.
  2. `get_input_embeddings(input_ids [T])` -> `[T, H]`; the runner writes item embeddings over the placeholders.
  3. `forward(None, positions, kv_caches, attn_metadata, inputs_embeds)` -> hidden `[T, H]`;
     `compute_logits(hidden [N, H])` -> `[N, V]` float32.
T = tokens in the step, H = LLM hidden size, V = vocab size.

Pipeline parallel (families whose `ModelCapabilities` say `pipeline_parallel`): the encoder parts (every part but
`language_model` and `lm_head`) live on the first stage only, which encodes the items and merges their embeddings;
later stages get the residual stream from the previous one. `keep_stage_parts` (the loader calls it before
materializing) drops the encoder parts off the other stages; `on_other_stage` tells the loader which checkpoint
tensors this stage skips. `lm_head` is on the last stage, read from the decoder's `embed_tokens.weight` when tied
and the embeddings live elsewhere. An encode server (mm_encoder_only) holds the encoder parts and the token
embeddings only (`keep_encoder_parts`), through the same skipping.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch

from vlserve.distributed.pipeline import is_last_stage
from vlserve.kernels.packed_linear import PackableLinear
from vlserve.models.capabilities import ModelCapabilities
from vlserve.models.causal_lm import DecoderWithLMHead
from vlserve.models.hf_config import text_config_of, token_id_of
from vlserve.models.llama import AbsentOnStage, LlamaDecoderModel
from vlserve.models.parallel_layers import ParallelLMHead, copy_weight

LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")


def image_token_of(hf_config) -> int | None:
    """The config's image placeholder token: `image_token_id`, else `image_token_index` (older LLaVA spelling)."""
    token = token_id_of(hf_config, "image_token_id")
    return token if token is not None else token_id_of(hf_config, "image_token_index")


class MultiModalLM(DecoderWithLMHead):
    """Encoder parts + `language_model` + `lm_head`; the load loop shared by the multimodal families.

    Under tensor parallelism only `language_model` and `lm_head` are sharded (`checkpoint_shard` routes names with
    `_split_name`); the encoder parts are replicated: every rank loads and runs them whole."""

    decoder_attr = "language_model"
    # (checkpoint prefix, part) pairs tried in order, longest prefix first; a part names an attribute of the
    # model, "language_model" the decoder. `lm_head.weight` / `language_model.lm_head.weight` go to lm_head.
    weight_prefixes: tuple[tuple[str, str], ...] = ()
    # Parts whose tensors are copied straight into their parameters (names relative to the part).
    copied_parts: tuple[str, ...] = ()
    # Parts with their own `load_weights(pairs) -> loaded names` and `expected_weight_names()`.
    delegated_parts: tuple[str, ...] = ()
    # Checkpoint names ending so carry nothing we need (RoPE buffers older checkpoints saved).
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    # The decoder `build_language_model` makes (Gemma 3: its own text decoder, a LlamaDecoderModel subclass).
    decoder_cls: type[LlamaDecoderModel] = LlamaDecoderModel

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.text_config = text_config_of(config)

    @classmethod
    def capabilities_for(cls, hf_config) -> ModelCapabilities:
        """`capabilities` with, for a family that takes images, the config's image placeholder token."""
        if "image" not in cls.capabilities.modalities:
            return cls.capabilities
        return replace(cls.capabilities, image_token_id=image_token_of(hf_config))

    def build_language_model(self, **decoder_kwargs) -> None:
        """Add `language_model` and `lm_head` (after the encoder parts) and tie them when the config says so."""
        self.language_model = self.decoder_cls(self.text_config, **decoder_kwargs)
        self.lm_head = (
            ParallelLMHead(self.text_config.hidden_size, self.text_config.vocab_size)
            if is_last_stage()
            else AbsentOnStage()
        )
        self.tie_weights()

    # ---- pipeline stages -------------------------------------------------------------------------------------------

    def encoder_parts(self) -> list[torch.nn.Module]:
        """The encoder parts: every child module but `language_model` and `lm_head` (towers, projectors, mergers)."""
        return [m for name, m in self.named_children() if name not in ("language_model", "lm_head")]

    def keep_stage_parts(self) -> None:
        """Off the first pipeline stage: replace every encoder part (child module other than `language_model` and
        `lm_head`) by an `AbsentOnStage` and drop the model's own parameters (LLaVA-NeXT's `image_newline`). A no-op
        on the first stage; the loader calls it on the meta-device model, before any memory is allocated."""
        if self.language_model.first_stage:
            return
        for name, _ in list(self.named_children()):
            if name not in ("language_model", "lm_head"):
                setattr(self, name, AbsentOnStage())
        for name in list(self._parameters):
            setattr(self, name, None)

    def keep_encoder_parts(self) -> None:
        """An encode server (mm_encoder_only): drop the decoder's layers, its final norm and `lm_head`, keeping the
        encoder parts and the token embeddings (`embed_dtype`, and Mistral 3's image break / end rows are read
        from them). The loader calls it on the meta-device model; `on_other_stage` then skips the dropped tensors
        (they are never read from the checkpoint)."""
        lm = self.language_model
        lm.layers = torch.nn.ModuleList(AbsentOnStage() for _ in range(lm.num_layers))
        lm.start_layer = lm.end_layer = 0
        lm.norm = AbsentOnStage()
        self.lm_head = AbsentOnStage()

    def on_other_stage(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to another pipeline stage only (the loader does not read it)."""
        part, rel = self._split_name(name)
        if part == "language_model":
            if rel == "embed_tokens.weight" and self.head_reads_embeddings():
                return False
            return self.language_model.on_other_stage(rel)
        if part == "lm_head":
            return isinstance(self.lm_head, AbsentOnStage) or self.tied
        return not self.language_model.first_stage  # encoder parts (and names of no part) are the first stage's

    @property
    def embed_dtype(self) -> torch.dtype:
        """The dtype `embed_multimodal` returns (the token embeddings')."""
        return self.language_model.embed_tokens.weight.dtype

    # ---- weights -------------------------------------------------------------------------------------------------

    def _split_name(self, name: str) -> tuple[str, str]:
        """Checkpoint name -> (part, name relative to it); part "" for names of no known part."""
        if name in LM_HEAD_NAMES:
            return "lm_head", "weight"
        for prefix, part in self.weight_prefixes:
            if name.startswith(prefix):
                return part, name[len(prefix) :]
        return "", name

    def encoder_linear_name(self, hf_module: str) -> str | None:
        """A checkpoint module name of the encoder parts (e.g. `model.visual.blocks.0.attn.qkv`) -> the name of our
        PackableLinear holding the same matrix (`visual.blocks.0.attn.qkv`), or None (a decoder module, or no such
        linear here: a fused or renamed one). Tower LoRA maps PEFT's targets through it."""
        part, rel = self._split_name(hf_module + ".weight")
        if part in ("", "language_model", "lm_head") or not hasattr(self, part):
            return None
        rel = rel[: -len(".weight")]
        modules = dict(getattr(self, part).named_modules())
        for candidate in (rel, rel.removeprefix("vision_model.")):  # CLIP-style towers load without it
            if isinstance(modules.get(candidate), PackableLinear):
                return f"{part}.{candidate}"
        return None

    def _load_extra(self, part: str, rel: str, tensor: torch.Tensor) -> str | None:
        """Hook for parts beyond the listed ones; returns the loaded name, or None for an unexpected weight."""
        return None

    def expected_weight_names(self) -> set[str]:
        """Every name `load_weights` must fill (model-relative, e.g. `language_model.layers.0...`)."""
        expected = {"language_model." + n for n in self.language_model.expected_weight_names()}
        for part in self.copied_parts:
            expected.update(f"{part}.{n}" for n, _ in getattr(self, part).named_parameters())
        for part in self.delegated_parts:
            if not isinstance(getattr(self, part), AbsentOnStage):
                expected.update(f"{part}.{n}" for n in getattr(self, part).expected_weight_names())
        if not isinstance(self.lm_head, AbsentOnStage) and (not self.tied or self.head_reads_embeddings()):
            expected.add("lm_head.weight")
        return expected

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a full HF checkpoint (either layout); ValueError lists missing/unexpected/mis-shaped names."""
        copied = {part: dict(getattr(self, part).named_parameters()) for part in self.copied_parts}
        delegated: dict[str, list[tuple[str, torch.Tensor]]] = {part: [] for part in self.delegated_parts}
        loaded: set[str] = set()
        unexpected: list[str] = []
        head_reads_embeddings = self.head_reads_embeddings()

        def decoder_weights():
            for name, tensor in weights:
                if name.endswith(self.ignored_suffixes):
                    continue
                part, rel = self._split_name(name)
                if part == "language_model" and rel == "embed_tokens.weight" and head_reads_embeddings:
                    self.lm_head.load_shard("weight", None, tensor, name)
                    loaded.add("lm_head.weight")
                elif self.on_other_stage(name):
                    continue
                elif part == "language_model":
                    yield rel, tensor
                elif part in delegated:
                    delegated[part].append((rel, tensor))
                elif part in copied and rel in copied[part]:
                    copy_weight(copied[part][rel], tensor, name)
                    loaded.add(f"{part}.{rel}")
                elif part == "lm_head":
                    if not self.tied:
                        self.lm_head.load_shard("weight", None, tensor, name)
                        loaded.add("lm_head.weight")
                else:
                    extra = self._load_extra(part, rel, tensor)
                    if extra is None:
                        unexpected.append(name)
                    else:
                        loaded.add(extra)

        loaded.update("language_model." + n for n in self.language_model.load_weights(decoder_weights()))
        if unexpected:
            raise ValueError(f"unexpected weights in checkpoint: {unexpected[:10]}")
        for part, pairs in delegated.items():
            if isinstance(getattr(self, part), AbsentOnStage):
                continue
            loaded.update(f"{part}.{n}" for n in getattr(self, part).load_weights(pairs))
        missing = sorted(self.expected_weight_names() - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:10]}")
