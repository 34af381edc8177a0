"""The CLIP / SigLIP text towers on batches of very different lengths (3 and 60 tokens) against HF: the tower computes
only the unpadded tokens for CLIP (`forward_unpadded`), every position for SigLIP, and both embed as HF does."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from tests.support.dual_tower_checkpoints import build_checkpoint, features
from vlserve.models import load_model

SHORT_AND_LONG = ["a", "abcdefghijklmnopqrstuvwxyz abcdefghijklmnopqrstuvwxyz abcdef"]  # CLIP: 3 and 60 tokens


@pytest.fixture(scope="module")
def clip77(tmp_path_factory):
    path = tmp_path_factory.mktemp("clip77")
    hf_model, processor = build_checkpoint("clip", path, text_positions=77)
    return str(path), hf_model, processor


def assert_close_rows(ours: torch.Tensor, ref: torch.Tensor, min_cos: float, max_abs: float) -> None:
    assert ours.shape == ref.shape
    cos = torch.nn.functional.cosine_similarity(ours.float(), ref.float(), dim=-1)
    assert cos.min().item() >= min_cos, cos
    assert (ours.float() - ref.float()).abs().max().item() <= max_abs


def test_clip_batch_of_3_and_60_tokens_matches_hf(clip77):
    path, hf_model, processor = clip77
    model = load_model(path, AutoConfig.from_pretrained(path), "float32", "cpu")
    inputs = processor(text=SHORT_AND_LONG, padding=True, return_tensors="pt")
    ids, mask = inputs["input_ids"], inputs["attention_mask"]  # [2, 60]
    assert mask.sum(dim=1).tolist() == [3, 60]
    with torch.no_grad():
        ref = features(hf_model.get_text_features(input_ids=ids, attention_mask=mask))  # [2, D]
        ref_hidden = hf_model.text_model(input_ids=ids, attention_mask=mask).last_hidden_state  # [2, 60, E]
    assert_close_rows(model.embed_text(ids, mask), ref, 0.9999, 1e-4)
    prompts = [torch.tensor(processor.tokenizer(t)["input_ids"]) for t in SHORT_AND_LONG]
    assert_close_rows(model.pool_prompts(prompts), ref, 0.9999, 1e-4)
    assert_close_rows(model.pool_prompts(prompts[::-1]), ref.flip(0), 0.9999, 1e-4)
    # the tower: the unpadded rows packed [63, E]; the padded layout [2, 60, E] as HF's, padding positions too
    unpadded = model.text_model.forward_unpadded(ids, mask)
    assert unpadded.shape == (63, ref_hidden.shape[-1])
    assert_close_rows(unpadded, ref_hidden[mask.bool()], 0.9999, 1e-4)
    assert_close_rows(model.text_model(ids, mask).flatten(0, 1), ref_hidden.flatten(0, 1), 0.9999, 1e-4)
    # the short text left-padded (with a non-EOS id): positions are the padded row's, as HF's
    left_ids, left_mask = ids.clone(), mask.clone()
    left_ids[0] = torch.cat([torch.full((57,), processor.tokenizer.bos_token_id), ids[0, :3]])
    left_mask[0] = torch.cat([torch.zeros(57, dtype=mask.dtype), mask[0, :3]])
    with torch.no_grad():
        left_ref = features(hf_model.get_text_features(input_ids=left_ids, attention_mask=left_mask))
    assert_close_rows(model.embed_text(left_ids, left_mask), left_ref, 0.9999, 1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_clip_packed_cpu_linears_on_3_and_60_tokens(clip77, dtype):
    """As the pooling runner runs it (linears packed for the CPU kernels), in float32 and bfloat16."""
    from vlserve.kernels.packed_linear import pack_linears_for_cpu

    path, hf_model, processor = clip77
    model = load_model(path, AutoConfig.from_pretrained(path), dtype, "cpu")
    pack_linears_for_cpu(model, many_rows=model.encoder_parts())
    prompts = [torch.tensor(processor.tokenizer(t)["input_ids"]) for t in SHORT_AND_LONG]
    inputs = processor(text=SHORT_AND_LONG, padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = features(hf_model.get_text_features(**inputs))
    min_cos, max_abs = (0.9999, 1e-4) if dtype == "float32" else (0.99, 0.1)
    assert_close_rows(model.pool_prompts(prompts), ref, min_cos, max_abs)


def test_siglip_keeps_every_position_of_a_masked_batch(tmp_path):
    """SigLIP pools the last position, padding or not: with a mask the tower still computes every position, and the
    pooled row is HF's (padding queries attend to the unpadded keys)."""
    hf_model, processor = build_checkpoint("siglip", tmp_path, text_positions=64)
    model = load_model(str(tmp_path), AutoConfig.from_pretrained(tmp_path), "float32", "cpu")
    texts = ["cat", " ".join(["the quick brown fox jumps over the mat"] * 7)]
    inputs = processor(text=texts, padding="max_length", max_length=64, return_tensors="pt")
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    assert mask.sum(dim=1).tolist() == [2, 57]
    for attention_mask in (mask, None):
        with torch.no_grad():
            ref = features(hf_model.get_text_features(input_ids=ids, attention_mask=attention_mask))
        assert_close_rows(model.embed_text(ids, attention_mask), ref, 0.9999, 1e-4)


def test_clip_last_layers_compute_only_the_pooled_rows(clip77):
    """CLIP pools one row per text (its EOS token) and per image (the class token): each tower's last layer runs its
    out_proj and MLP on those rows alone, and the embeddings still match HF's."""
    path, hf_model, processor = clip77
    model = load_model(path, AutoConfig.from_pretrained(path), "float32", "cpu")
    seen: dict[str, list[int]] = {"text": [], "vision": []}
    hooks = [
        getattr(model, f"{name}_model")
        .encoder.layers[-1]
        .mlp.register_forward_hook(lambda m, a, o, name=name: seen[name].append(a[0].shape[0]))
        for name in seen
    ]
    inputs = processor(text=SHORT_AND_LONG, padding=True, return_tensors="pt")
    side = hf_model.config.vision_config.image_size
    pixels = torch.randn(3, 3, side, side, generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            texts = model.embed_text(inputs["input_ids"], inputs["attention_mask"])
            images = model.embed_image(pixels)
    finally:
        for h in hooks:
            h.remove()
    assert seen == {"text": [2], "vision": [3]}
    with torch.no_grad():
        ref_texts = features(hf_model.get_text_features(**inputs))
        ref_images = features(hf_model.get_image_features(pixel_values=pixels))
    assert_close_rows(texts, ref_texts, 0.9999, 1e-4)
    assert_close_rows(images, ref_images, 0.9999, 1e-4)
