"""Qwen2-VL with images through the offloading tier: the tier key folds in each image's mm_hash, so the same text
with another image never loads the first image's blocks; greedy tokens equal the run without a tier."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

from vlserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
TEXT = "Describe the picture in great detail, mentioning colours, shapes and anything unusual you notice."


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 56, 3), dtype=np.uint8))


def _run(llm: LLM, images) -> list[list[int]]:
    outs = []
    for img in images:
        outs.append(llm.generate(TEXT, GREEDY, images=[img], use_tqdm=False)[0].outputs[0].token_ids)
        llm.check_integrity()
    return outs


@pytest.mark.slow
def test_vl_tier_same_tokens_and_no_cross_image_hits(qwen2_vl_dir):
    a, b = _image(1), _image(2)
    order = [a, b, a, b]
    kw = dict(dtype="float32", num_kv_blocks=24, block_size=4, max_model_len=96, seed=0)
    ref = LLM(qwen2_vl_dir, **kw)
    expected = _run(ref, order)
    prompt = ref.generate(TEXT, SamplingParams(max_tokens=1), images=[b], use_tqdm=False)[0].prompt_token_ids
    del ref
    assert expected[0] != expected[1]  # the images matter

    llm = LLM(qwen2_vl_dir, kv_offloading_size=0.01, **kw)
    assert _run(llm, order[:1]) == expected[:1]
    before = llm.get_metrics()["vlserve:kv_offload_hit_tokens_total"]
    assert _run(llm, order[1:2]) == expected[1:2]
    m = llm.get_metrics()
    with open(os.path.join(qwen2_vl_dir, "config.json")) as f:
        image_token = json.load(f)["image_token_id"]
    image_start = prompt.index(image_token)
    # B loaded at most the blocks wholly before its image; never a block holding A's image
    loaded_b = m["vlserve:kv_offload_hit_tokens_total"] - before
    assert loaded_b <= image_start // 4 * 4
    before = llm.get_metrics()["vlserve:kv_offload_hit_tokens_total"]
    assert _run(llm, order[2:3]) == expected[2:3]
    # A again: its image blocks come back from the tier (the device pool gave them to B)
    assert llm.get_metrics()["vlserve:kv_offload_hit_tokens_total"] - before > image_start
    assert _run(llm, order[3:]) == expected[3:]
    llm.check_integrity()


@pytest.mark.slow
def test_vl_disk_tier_other_image_loads_only_the_text_before_it(qwen2_vl_dir, tmp_path):
    """A fresh engine (empty device pool) over the disk tier another engine filled with image A: the same text with
    image B loads only the blocks before the image, A again loads all it can; tokens as without a tier."""
    a, b = _image(1), _image(2)
    kw = dict(dtype="float32", num_kv_blocks=24, block_size=4, max_model_len=96, seed=0)
    ref = LLM(qwen2_vl_dir, **kw)
    expected_a, expected_b = _run(ref, [a, b])
    prompt = ref.generate(TEXT, SamplingParams(max_tokens=1), images=[a], use_tqdm=False)[0].prompt_token_ids
    del ref
    with open(os.path.join(qwen2_vl_dir, "config.json")) as f:
        image_start = prompt.index(json.load(f)["image_token_id"])

    assert _run(LLM(qwen2_vl_dir, kv_offloading_dir=str(tmp_path), **kw), [a]) == [expected_a]
    fresh = LLM(qwen2_vl_dir, kv_offloading_dir=str(tmp_path), **kw)
    assert _run(fresh, [b]) == [expected_b]
    assert fresh.get_metrics()["vlserve:kv_offload_hit_tokens_total"] == image_start // 4 * 4
    fresh = LLM(qwen2_vl_dir, kv_offloading_dir=str(tmp_path), **kw)
    assert _run(fresh, [a]) == [expected_a]
    assert fresh.get_metrics()["vlserve:kv_offload_hit_tokens_total"] == (len(prompt) - 1) // 4 * 4
