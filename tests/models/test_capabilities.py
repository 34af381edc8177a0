"""The model contract (vlserve.models.capabilities): every registered class states its `ModelCapabilities` in its own
body, the statement matches what the class implements, the values a config decides are read from it, and no module
outside vlserve/models probes a model for optional attributes (read from the source with `ast`)."""

from __future__ import annotations

import ast
import pathlib
from dataclasses import fields
from types import SimpleNamespace

import pytest
from transformers import AutoConfig

from vlserve.models.capabilities import DECODER_LORA_TARGETS, ModelCapabilities, model_capabilities, stated_capabilities
from vlserve.models.causal_lm import DecoderWithLMHead
from vlserve.models.mm_wrapper import MultiModalLM
from vlserve.models.registry import get_model_class, supported_architectures

PKG_ROOT = pathlib.Path(__file__).resolve().parents[2] / "vlserve"


def registered_classes() -> dict[str, type]:
    return {arch: get_model_class(SimpleNamespace(architectures=[arch])) for arch in supported_architectures()}


@pytest.mark.parametrize("arch", supported_architectures())
def test_every_registered_class_states_its_capabilities(arch):
    """Stated in the class's own body (a subclass restates its parent's on purpose, never inherits it silently),
    and only what the class implements."""
    cls = registered_classes()[arch]
    caps = vars(cls).get("capabilities")
    assert isinstance(caps, ModelCapabilities), f"{cls.__name__} does not state its own ModelCapabilities"
    assert stated_capabilities(cls) is caps
    assert caps.multimodal == issubclass(cls, MultiModalLM)
    assert caps.pooling == (caps.dual_tower or caps.kv_free)  # all generate, but dual-tower and encoder-only ones
    implements = {
        "mrope": "get_mrope_input_positions",
        "pipeline_parallel": "on_other_stage",
        "tensor_parallel": "checkpoint_shard",
        "encoder_lora": "encoder_linear_name",
        "mm_encoder_only": "keep_encoder_parts",
        "multimodal": "embed_multimodal",
    }
    for capability, method in implements.items():
        if getattr(caps, capability):
            assert callable(getattr(cls, method, None)), f"{cls.__name__}: {capability} without {method}"


def test_a_class_that_states_nothing_is_refused():
    class Unstated(DecoderWithLMHead):
        pass

    for cls in (Unstated, object):
        with pytest.raises(TypeError, match="states no ModelCapabilities"):
            model_capabilities(cls, SimpleNamespace())


def test_config_values():
    """Token ids and encoder stages come from the checkpoint's config; the statement leaves them at their defaults."""
    qwen2_vl, qwen3_vl = AutoConfig.for_model("qwen2_vl"), AutoConfig.for_model("qwen3_vl")
    gemma3, llava, audio = (
        AutoConfig.for_model("gemma3"),
        AutoConfig.for_model("llava"),
        AutoConfig.for_model("qwen2_audio"),
    )
    classes = registered_classes()
    caps = model_capabilities(classes["Qwen2VLForConditionalGeneration"], qwen2_vl)
    depth = qwen2_vl.vision_config.depth
    assert caps.encoder_stage_counts == {"image": depth, "video": depth}
    assert caps.image_token_id == qwen2_vl.image_token_id and caps.bidirectional_token_id is None
    assert not stated_capabilities(classes["Qwen2VLForConditionalGeneration"]).encoder_stage_counts
    caps = model_capabilities(classes["Qwen3VLForConditionalGeneration"], qwen3_vl)
    assert caps.encoder_stage_counts == {} and caps.image_token_id == qwen3_vl.image_token_id  # one-piece tower
    caps = model_capabilities(classes["Gemma3ForConditionalGeneration"], gemma3)
    assert caps.image_token_id == gemma3.boi_token_index and caps.bidirectional_token_id == gemma3.image_token_index
    assert caps.unsplit_mm_items
    assert model_capabilities(classes["LlavaForConditionalGeneration"], llava).image_token_id == llava.image_token_index
    assert model_capabilities(classes["Qwen2AudioForConditionalGeneration"], audio).image_token_id is None
    text = model_capabilities(classes["LlamaForCausalLM"], AutoConfig.for_model("llama"))
    assert text == stated_capabilities(classes["LlamaForCausalLM"])
    assert text.lora_targets == DECODER_LORA_TARGETS and text.pipeline_parallel and not text.multimodal


def test_gemma3_config_without_its_image_tokens_is_refused():
    cls = registered_classes()["Gemma3ForConditionalGeneration"]
    with pytest.raises(ValueError, match="needs image_token_index and boi_token_index"):
        model_capabilities(cls, SimpleNamespace(image_token_index=5))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"unsplit_mm_items": True},
        {"encoder_lora": True},
        {"mm_encoder_only": True},
        {"image_token_id": 3},
        {"bidirectional_token_id": 3},
        {"pipeline_parallel": True, "pipeline_parallel_refusal": "why"},
        {"lora_targets": ("q_proj",)},
        {"dual_tower": True},
        {"modalities": ("image",), "encoder_stage_counts": {"video": 4}},
        {"modalities": ("image",), "encoder_stage_counts": {"image": 0}},
    ],
)
def test_inconsistent_statements_are_refused(kwargs):
    with pytest.raises(ValueError, match="inconsistent ModelCapabilities"):
        ModelCapabilities(**kwargs)


# ---- no probing outside vlserve/models -------------------------------------------------------------------------------

SKIPPED_DIRS = {
    "models",  # the contract and the classes that state it
    "testing",
    "bench",
}  # test and benchmark support: they drive transformers' own models
# (file, attribute) probes of transformers' models, not ours
ALLOWED = {("training/audio_build.py", "model")}  # Qwen2-Audio nests its tower under `.model` in 5.x, not in 4.x
MODEL_NAMES = {"model", "model_cls", "cls", "draft", "target", "draft_model", "target_model"}
# What a model class states or implements; `image_token_id` is left out: HF processors have one too.
CONTRACT_NAMES = ({f.name for f in fields(ModelCapabilities)} - {"image_token_id"}) | {
    "capabilities",
    "capabilities_for",
    "multimodal",
    "supported_modalities",
    "encoder_parts",
    "keep_encoder_parts",
    "keep_stage_parts",
    "checkpoint_shard",
    "encoder_linear_name",
    "embed_multimodal",
    "begin_encode_stages",
    "lm_head",
    "uses_mrope",
}


def _object_name(node: ast.expr) -> str | None:
    """The name a probed expression ends in: `model`, `self.model`, `loaded.model`, `type(model)`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type" and node.args:
        return _object_name(node.args[0])
    return None


def model_probes(source: str) -> list[tuple[int, str]]:
    """(line, probed attribute or "?") of each getattr / hasattr call on a model-like name, or of a contract
    attribute on anything."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
        ):
            continue
        target, attr = node.args[0], node.args[1]
        name = attr.value if isinstance(attr, ast.Constant) and isinstance(attr.value, str) else "?"
        on_model = _object_name(target) in MODEL_NAMES
        contract = name in CONTRACT_NAMES or name.startswith("supports_")
        if on_model or contract:
            found.append((node.lineno, name))
    return found


def test_the_probe_finder_finds_probes():
    source = """
getattr(model, "supports_anything", False)
hasattr(self.model, "encoder_parts")
getattr(model_cls, "unsplit_mm_items", False)
getattr(type(model), "whatever", None)
getattr(loaded.model, "something", None)
getattr(thing, "bidirectional_token_id", None)
getattr(hf_processor, "image_token_id", None)
getattr(logging, "INFO")
"""
    assert [line for line, _ in model_probes(source)] == [2, 3, 4, 5, 6, 7]


def test_no_module_outside_models_probes_a_model():
    probes = []
    for path in sorted(PKG_ROOT.rglob("*.py")):
        rel = path.relative_to(PKG_ROOT)
        if rel.parts[0] in SKIPPED_DIRS:
            continue
        probes += [
            f"vlserve/{rel}:{line} ({attr})"
            for line, attr in model_probes(path.read_text())
            if (rel.as_posix(), attr) not in ALLOWED
        ]
    assert not probes, "read the model's ModelCapabilities (vlserve.models.capabilities) instead: " + ", ".join(probes)


def test_lora_wraps_only_the_stated_targets():
    import torch

    from vlserve.lora.model_manager import LoRAModelManager
    from vlserve.models.causal_lm import LlamaForCausalLM

    class AttentionLoRA(LlamaForCausalLM):
        capabilities = ModelCapabilities(lora_targets=("qkv_proj", "o_proj"))

    class NoLoRA(LlamaForCausalLM):
        capabilities = ModelCapabilities()

    config = AutoConfig.for_model(
        "llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    with torch.device("meta"):
        attention_only, no_lora = AttentionLoRA(config), NoLoRA(config)
    manager = LoRAModelManager(attention_only, max_loras=1, max_lora_rank=4)
    assert sorted(manager.targets) == [f"layers.{i}.self_attn.{p}" for i in range(2) for p in ("o_proj", "qkv_proj")]
    with pytest.raises(ValueError, match="NoLoRA does not support LoRA adapters"):
        LoRAModelManager(no_lora, max_loras=1, max_lora_rank=4)
