"""Qwen2-VL / Qwen2.5-VL checkpoints whose LM head is tied to the embeddings (Qwen2-VL-2B's layout): transformers
5.x keeps the flag only at the top level of the config, 4.57 in the text config too; either way vlserve ties and
matches HF generate."""

import json
import os

import pytest
from PIL import Image
from safetensors import safe_open

from tests.multimodal.mm_media import rand_image
from tests.multimodal.test_mm_engine_parity import MAX_NEW, HFOracle, _chat_text, _greedy
from vlserve import LLM
from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

pytestmark = pytest.mark.hf_parity


@pytest.mark.parametrize("variant", ["qwen2_vl", "qwen2_5_vl"])
def test_tied_lm_head_matches_hf(tmp_path, variant):
    model_dir = build_qwen2_vl_checkpoint(str(tmp_path / variant), variant=variant, tie_word_embeddings=True)
    path = os.path.join(model_dir, "config.json")
    config = json.load(open(path))
    if "tie_word_embeddings" in config:  # 5.x writes the top-level flag (4.57 reads the text config's)
        # as a flat (4.x-style) config such as Qwen2-VL-2B's reads in 5.x: the flag at the top level only
        assert config["tie_word_embeddings"] is True
        config.get("text_config", {}).pop("tie_word_embeddings", None)
        json.dump(config, open(path, "w"))
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        assert not any(k.endswith("lm_head.weight") for k in f.keys())  # only the embedding is stored
    oracle = HFOracle(model_dir)
    text = _chat_text(oracle.processor.tokenizer, 1, 0, "What is this?")
    image = Image.fromarray(rand_image(56, 84, seed=5))
    want = oracle.greedy(text, images=[image])
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64)
    got = llm.generate([{"prompt": text, "multi_modal_data": {"image": image}}], _greedy(MAX_NEW), use_tqdm=False)
    assert got[0].outputs[0].token_ids == want
