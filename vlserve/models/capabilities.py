"""The one contract between a model class and the engine: `ModelCapabilities`.

Every registered model class states its own in its class body, `capabilities = ModelCapabilities(...)`; the values
a checkpoint's config decides (token ids, encoder stages) are filled by the class's `capabilities_for(hf_config)`
(`DecoderWithLMHead`'s returns the statement as is). The engine reads them through `model_capabilities(cls,
hf_config)` or `capabilities_of(model)`, never by probing a model for optional attributes. Defaults are the
least a model may offer: a text-only causal LM on one device, without LoRA.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The decoder projections LoRA adapters can target (vlserve.lora): fused q/k/v, o, the dense MLP's gate/up and down.
DECODER_LORA_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ModelCapabilities:
    """What a model class offers the engine beyond the calls every model answers (`get_input_embeddings`,
    `forward`, `compute_logits`, `load_weights`, `encoder_parts`)."""

    modalities: tuple[str, ...] = ()
    """The media `embed_multimodal(modality, data)` takes ("image", "video", "audio"); () for a text-only model."""
    mrope: bool = False
    """Positions are M-RoPE's three axes, computed per prompt from its media (`vlserve.multimodal.mrope`)."""
    unsplit_mm_items: bool = False
    """The scheduler keeps each item's placeholder run inside one step (a bidirectional run needs all its keys)."""
    pipeline_parallel: bool = False
    """It builds and loads one pipeline stage's share (`on_other_stage`; a VLM's `keep_stage_parts`)."""
    pipeline_parallel_refusal: str = ""
    """Why it does not split over pipeline stages, for the error ("" for the generic reason)."""
    tensor_parallel: bool = False
    """Its decoder and lm_head shard over tensor-parallel ranks (`checkpoint_shard`)."""
    lora_targets: tuple[str, ...] = ()
    """The decoder projections LoRA adapters may target (of DECODER_LORA_TARGETS); () for no LoRA."""
    encoder_lora: bool = False
    """Adapters may also target the encoder parts' linears (towers, projectors), found by `encoder_linear_name`."""
    mm_encoder_only: bool = False
    """It can serve as an encode server: encoder parts and token embeddings only (`keep_encoder_parts`)."""
    pooling: bool = False
    """A pooling (embedding) model: no lm_head, no sampling (EAGLE drafting refuses it)."""
    classifier_head: bool = False
    """A sequence classifier: `compute_logits` applies its `score` head (class logits), not an LM head."""
    dual_tower: bool = False
    """A dual-tower (CLIP / SigLIP) embedder (vlserve.models.dual_tower): it has no decoder, KV cache nor
    `embed_multimodal`; the pooling runner calls its `embed_text(input_ids, attention_mask)` or
    `embed_image(pixel_values)` per request, and no generation path may take it. Implies `pooling`."""
    kv_free: bool = False
    """An encoder-only pooling model (BERT): no KV cache; the pooling runner calls its `pool_prompts(token_ids, spec)`."""
    image_token_id: int | None = None
    """From the config: the prompt's image placeholder token, before the processor expands it."""
    bidirectional_token_id: int | None = None
    """From the config: runs of this token attend to each other both ways in prefill (Gemma 3's image soft
    tokens); None for causal attention only."""
    encoder_stage_counts: Mapping[str, int] = field(default_factory=dict, hash=False)
    """From the config: per modality, the stages one item's encoding may be split into across steps
    (`vlserve.encoders.staged`: then `begin_encode_stages` / `run_encode_stages` / `finish_encode_stages`); a
    modality not named is encoded in one piece."""

    def __post_init__(self) -> None:
        media_only = {
            "unsplit_mm_items": self.unsplit_mm_items,
            "encoder_lora": self.encoder_lora,
            "mm_encoder_only": self.mm_encoder_only,
            "image_token_id": self.image_token_id is not None,
            "bidirectional_token_id": self.bidirectional_token_id is not None,
            "encoder_stage_counts": bool(self.encoder_stage_counts),
        }
        wrong = [name for name, value in media_only.items() if value and not self.modalities]
        wrong += ["pipeline_parallel_refusal"] if self.pipeline_parallel and self.pipeline_parallel_refusal else []
        wrong += ["dual_tower without pooling"] if self.dual_tower and not self.pooling else []
        wrong += [f"lora_targets {t!r}" for t in self.lora_targets if t not in DECODER_LORA_TARGETS]
        wrong += [
            f"encoder_stage_counts[{m!r}]"
            for m, n in self.encoder_stage_counts.items()
            if m not in self.modalities or n < 1
        ]
        if wrong:
            raise ValueError(f"inconsistent ModelCapabilities: {', '.join(wrong)} ({self})")

    @property
    def multimodal(self) -> bool:
        """Whether it takes any media."""
        return bool(self.modalities)


def stated_capabilities(model_cls: type) -> ModelCapabilities:
    """What `model_cls` states, before any config (the fields a config decides at their defaults); TypeError for
    a class that states none."""
    stated = getattr(model_cls, "capabilities", None)
    if not isinstance(stated, ModelCapabilities):
        raise TypeError(f"{model_cls.__name__} states no ModelCapabilities (class attribute `capabilities`)")
    return stated


def model_capabilities(model_cls: type, hf_config: Any) -> ModelCapabilities:
    """What `model_cls` offers for a checkpoint of `hf_config`: its statement with the config's values filled in."""
    stated_capabilities(model_cls)
    return model_cls.capabilities_for(hf_config)


def capabilities_of(model: Any) -> ModelCapabilities:
    """A built model's capabilities: its class's, for the config it was built from (`model.config`)."""
    return model_capabilities(type(model), model.config)
