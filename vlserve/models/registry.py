"""Model registry: HF `architectures[0]` -> vlserve model class.

Entries are classes or lazy `"module:ClassName"` strings (imported on first use), so heavy or optional models
(multimodal ones) cost nothing until asked for. Add models with `register_model`.
"""

from __future__ import annotations

import importlib

from vlserve.models.hf_config import architectures_of

_REGISTRY: dict[str, type | str] = {
    "LlamaForCausalLM": "vlserve.models.causal_lm:LlamaForCausalLM",
    "MistralForCausalLM": "vlserve.models.causal_lm:LlamaForCausalLM",  # Llama plus a sliding window, no biases
    "Qwen2ForCausalLM": "vlserve.models.causal_lm:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "vlserve.models.causal_lm:Qwen3ForCausalLM",
    "Gemma3ForCausalLM": "vlserve.models.gemma3:Gemma3ForCausalLM",
    "LlamaForSequenceClassification": "vlserve.models.pooling_adapters:LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification": "vlserve.models.pooling_adapters:Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification": "vlserve.models.pooling_adapters:Qwen3ForSequenceClassification",
    "Qwen2VLForConditionalGeneration": "vlserve.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "vlserve.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration": "vlserve.models.qwen3_vl:Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration": "vlserve.models.qwen3_vl:Qwen3VLMoeForConditionalGeneration",
    "PerceptionLMForConditionalGeneration": "vlserve.models.perception_lm:PerceptionLMForConditionalGeneration",
    "Qwen2AudioForConditionalGeneration": "vlserve.models.qwen2_audio:Qwen2AudioForConditionalGeneration",
    "LlavaForConditionalGeneration": "vlserve.models.llava:LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration": "vlserve.models.llava_next:LlavaNextForConditionalGeneration",
    "InternVLForConditionalGeneration": "vlserve.models.internvl:InternVLForConditionalGeneration",
    "Mistral3ForConditionalGeneration": "vlserve.models.mistral3:Mistral3ForConditionalGeneration",
    "Gemma3ForConditionalGeneration": "vlserve.models.gemma3_mm:Gemma3ForConditionalGeneration",
    # dual-tower embedders (capabilities.dual_tower): served by the pooling runner only
    "CLIPModel": "vlserve.models.dual_tower:CLIPDualTower",
    "SiglipModel": "vlserve.models.dual_tower:SiglipDualTower",
    # encoder-only pooling models (capabilities.kv_free): served by the pooling runner only
    "BertModel": "vlserve.models.bert:BertEmbeddingModel",
    "BertForSequenceClassification": "vlserve.models.bert:BertForSequenceClassification",
}


def register_model(arch_name: str, cls: type | str) -> None:
    """Map HF architecture name `arch_name` to `cls` (a class or a lazy "module.path:ClassName" string)."""
    _REGISTRY[arch_name] = cls


def supported_architectures() -> list[str]:
    """Sorted list of registered architecture names."""
    return sorted(_REGISTRY)


def _resolve(entry: type | str) -> type:
    if isinstance(entry, str):
        module_name, _, cls_name = entry.partition(":")
        return getattr(importlib.import_module(module_name), cls_name)
    return entry


def get_model_class(hf_config) -> type:
    """The model class for the config's first architecture (top level, or nested in `text_config` as 4.57 saves
    some multimodal configs); ValueError naming it, where it was read, and the supported ones otherwise."""
    supported = "supported architectures: " + ", ".join(supported_architectures())
    try:
        archs, where = architectures_of(hf_config)
    except ValueError as e:
        raise ValueError(f"{e}; {supported}") from None
    arch = archs[0]
    if arch not in _REGISTRY:
        raise ValueError(f"unsupported model architecture {arch!r} (from {where}); {supported}")
    cls = _resolve(_REGISTRY[arch])
    _REGISTRY[arch] = cls
    return cls
