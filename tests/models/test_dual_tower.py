"""Dual-tower embedders (vlserve.models.dual_tower) against HF's CLIPModel / SiglipModel: tiny random checkpoints
saved with save_pretrained, inputs from the families' processors (CLIP: CLIPProcessor with a CLIPTokenizer built
from a local character vocabulary; SigLIP: SiglipProcessor with SiglipImageProcessor and a local word-level fast
tokenizer, since SigLIP's own tokenizer needs a sentencepiece model), loaded through vlserve's load_model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from tests.support.dual_tower_checkpoints import TEXTS, build_checkpoint, features
from vlserve.models import load_model
from vlserve.models.capabilities import model_capabilities
from vlserve.models.dual_tower import CLIPDualTower, SiglipDualTower
from vlserve.models.registry import get_model_class


@pytest.fixture(scope="module", params=["clip", "siglip"])
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model, processor = build_checkpoint(request.param, path)
    return request.param, str(path), hf_model, processor


def text_inputs(family_name: str, processor, texts=TEXTS) -> dict:
    if family_name == "clip":
        return processor(text=texts, padding=True, return_tensors="pt")
    return processor(text=texts, padding="max_length", max_length=16, return_tensors="pt")


def image_inputs(processor) -> torch.Tensor:
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8) for h, w in [(40, 50), (32, 32), (64, 36)]]
    return processor(images=images, return_tensors="pt")["pixel_values"]


def assert_close_rows(ours: torch.Tensor, ref: torch.Tensor, min_cos: float, max_abs: float) -> None:
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(ours, ref.float(), dim=-1)
    assert cos.min().item() >= min_cos, cos
    assert (ours - ref.float()).abs().max().item() <= max_abs


def test_registry_routes_both_families_to_dual_towers(family):
    name, path, _, _ = family
    config = AutoConfig.from_pretrained(path)
    cls = get_model_class(config)
    assert cls is {"clip": CLIPDualTower, "siglip": SiglipDualTower}[name]
    caps = model_capabilities(cls, config)
    assert caps.dual_tower and caps.pooling and caps.kv_free and caps.modalities == ("image",)


def test_text_features_match_hf_with_padding(family):
    name, path, hf_model, processor = family
    model = load_model(path, AutoConfig.from_pretrained(path), "float32", "cpu")
    inputs = text_inputs(name, processor)
    assert (inputs["attention_mask"] == 0).any()  # mixed lengths: some rows are padded
    ours = model.embed_text(inputs["input_ids"], inputs["attention_mask"])
    with torch.no_grad():
        ref = features(
            hf_model.get_text_features(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        )
    assert ours.shape == (len(TEXTS), model.projection_dim)
    assert_close_rows(ours, ref, 0.9999, 1e-4)
    # one text alone (no padding) embeds as it does in the padded batch
    alone = text_inputs(name, processor, TEXTS[:1])
    assert_close_rows(model.embed_text(alone["input_ids"], alone["attention_mask"]), ours[:1], 0.9999, 1e-4)
    if name == "siglip":  # SigLIP is usually run without a mask: padding then attends like any token
        with torch.no_grad():
            ref = features(hf_model.get_text_features(input_ids=inputs["input_ids"]))
        assert_close_rows(model.embed_text(inputs["input_ids"]), ref, 0.9999, 1e-4)


def test_image_features_match_hf(family):
    name, path, hf_model, processor = family
    model = load_model(path, AutoConfig.from_pretrained(path), "float32", "cpu")
    pixels = image_inputs(processor)
    with torch.no_grad():
        ref = features(hf_model.get_image_features(pixel_values=pixels))
    ours = model.embed_image(pixels)
    assert ours.shape == (pixels.shape[0], model.projection_dim)
    assert_close_rows(ours, ref, 0.9999, 1e-4)


def test_logits_per_image_match_hf(family):
    name, path, hf_model, processor = family
    model = load_model(path, AutoConfig.from_pretrained(path), "float32", "cpu")
    text, pixels = text_inputs(name, processor), image_inputs(processor)
    with torch.no_grad():
        out = hf_model(input_ids=text["input_ids"], attention_mask=text["attention_mask"], pixel_values=pixels)
    logits_per_text = model.similarity(
        model.embed_text(text["input_ids"], text["attention_mask"]), model.embed_image(pixels)
    )
    assert torch.allclose(logits_per_text.T, out.logits_per_image, atol=1e-4, rtol=0)
    assert torch.allclose(model.logit_scale.float(), hf_model.logit_scale.float())


def test_bf16_is_close_to_hf_float32(family):
    name, path, hf_model, processor = family
    model = load_model(path, AutoConfig.from_pretrained(path), "bfloat16", "cpu")
    assert model.text_model.embeddings.token_embedding.weight.dtype == torch.bfloat16
    text, pixels = text_inputs(name, processor), image_inputs(processor)
    with torch.no_grad():
        ref_text = features(
            hf_model.get_text_features(input_ids=text["input_ids"], attention_mask=text["attention_mask"])
        )
        ref_image = features(hf_model.get_image_features(pixel_values=pixels))
    assert_close_rows(model.embed_text(text["input_ids"], text["attention_mask"]), ref_text, 0.99, 0.1)
    assert_close_rows(model.embed_image(pixels), ref_image, 0.99, 0.1)


def test_clip_legacy_eos_rule_pools_at_the_largest_id(tmp_path):
    """Configs with eos_token_id 2 (before HF fixed it) pool where the largest id is, as HF still does."""
    hf_model, processor = build_checkpoint("clip", tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    model = load_model(str(tmp_path), config, "float32", "cpu")
    hf_model.text_model.eos_token_id = 2
    model.eos_token_id = 2
    inputs = text_inputs("clip", processor)
    with torch.no_grad():
        ref = features(
            hf_model.get_text_features(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        )
    ours = model.embed_text(inputs["input_ids"], inputs["attention_mask"])
    assert_close_rows(ours, ref, 0.9999, 1e-4)
    expected = inputs["input_ids"].argmax(dim=-1)
    assert torch.equal(model.eos_positions(inputs["input_ids"]), expected)


def test_bad_inputs_are_refused(family):
    name, path, _, processor = family
    model = load_model(path, AutoConfig.from_pretrained(path), "float32", "cpu")
    ids = text_inputs(name, processor)["input_ids"]
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model.embed_text(ids[0])
    with pytest.raises(ValueError, match="must lie in"):
        model.embed_text(ids.clamp(max=0) + 10_000)
    with pytest.raises(ValueError, match="exceeds"):
        model.embed_text(ids[:, :1].repeat(1, 64))
    with pytest.raises(ValueError, match="attention_mask shape"):
        model.embed_text(ids, torch.ones(ids.shape[0], ids.shape[1] + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one token"):
        model.embed_text(ids, torch.zeros_like(ids))
    with pytest.raises(ValueError, match="pixel_values must be"):
        model.embed_image(torch.zeros(1, 3, 16, 16))
    with pytest.raises(ValueError, match=r"\[B, D\] and \[N, D\]"):
        model.similarity(torch.zeros(2, model.projection_dim), torch.zeros(2, model.projection_dim + 1))
    with pytest.raises(TypeError, match="dual-tower"):
        model(ids)
    if name == "clip":
        eos = processor.tokenizer.eos_token_id
        with pytest.raises(ValueError, match="must contain the EOS"):
            model.embed_text(torch.where(ids == eos, torch.full_like(ids, 3), ids))
        left = processor(text=TEXTS, padding=True, return_tensors="pt", padding_side="left")
        with pytest.raises(ValueError, match="pad on the right"):
            model.embed_text(left["input_ids"], left["attention_mask"])


def test_a_checkpoint_missing_a_weight_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    build_checkpoint("siglip", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["vision_model.head.probe"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="vision_model.head.probe"):
        load_model(str(tmp_path), AutoConfig.from_pretrained(tmp_path), "float32", "cpu")


def test_the_generation_engine_refuses_a_dual_tower(family):
    from vlserve.llm import LLM

    _, path, _, _ = family
    with pytest.raises(ValueError, match="dual-tower embedder.*runner='pooling'"):
        LLM(path, runner="generate")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_cpu_linears_give_the_same_embeddings(family, dtype):
    """Packed as the runner packs a VLM's towers (CPU kernels / oneDNN prepacking), the embeddings stay HF's."""
    from vlserve.kernels.packed_linear import pack_linears_for_cpu

    name, path, hf_model, processor = family
    model = load_model(path, AutoConfig.from_pretrained(path), dtype, "cpu")
    text, pixels = text_inputs(name, processor), image_inputs(processor)
    before = model.embed_text(text["input_ids"], text["attention_mask"]), model.embed_image(pixels)
    pack_linears_for_cpu(model, many_rows=model.encoder_parts())
    after = model.embed_text(text["input_ids"], text["attention_mask"]), model.embed_image(pixels)
    min_cos, max_abs = (0.9999, 1e-4) if dtype == "float32" else (0.99, 0.1)
    for b, a in zip(before, after):
        assert_close_rows(a, b, min_cos, max_abs)
    with torch.no_grad():
        ref = features(hf_model.get_image_features(pixel_values=pixels))
    assert_close_rows(after[1], ref, min_cos, max_abs)


def test_pool_prompts_batches_prompts_of_any_length(family):
    """The KV-free pooling call: whole prompts of different lengths in one call embed as each does alone (CLIP pads
    them under a mask; SigLIP, pooling the last position, runs each length as its own batch)."""
    name, path, _, processor = family
    model = load_model(path, AutoConfig.from_pretrained(path), "float32", "cpu")
    prompts = [torch.tensor(processor.tokenizer(t)["input_ids"]) for t in TEXTS]  # unpadded: lengths differ
    prompts.append(prompts[0].clone())  # a length seen twice shares its batch
    assert len({p.numel() for p in prompts}) > 1
    pooled = model.pool_prompts(prompts)
    alone = torch.cat([model.embed_text(p[None]) for p in prompts])
    assert_close_rows(pooled, alone, 0.9999, 1e-5)
    with pytest.raises(ValueError, match="non-empty"):
        model.pool_prompts([torch.tensor([], dtype=torch.long)])
    with pytest.raises(ValueError, match="embeds texts and images"):
        model.embed_multimodal("video", {})
    pixels = image_inputs(processor)
    assert torch.equal(model.embed_multimodal("image", {"pixel_values": pixels}), model.embed_image(pixels))
