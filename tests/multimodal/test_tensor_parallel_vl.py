"""Qwen2-VL over two tensor-parallel gloo ranks (the vision tower's blocks and the language model sharded):
greedy token for token with HF on image prompts, with chunked prefill splitting the image placeholders."""

from __future__ import annotations

import pytest
from PIL import Image

from tests.multimodal.mm_media import rand_image
from tests.multimodal.test_mm_engine_parity import HFOracle, _chat_text, _greedy
from vlserve import LLM

pytestmark = [pytest.mark.slow, pytest.mark.hf_parity]


def test_qwen2_vl_tp2_matches_hf_on_images(qwen2_vl_dir):
    hf = HFOracle(qwen2_vl_dir)
    tok = hf.processor.tokenizer
    img_a, img_b = (Image.fromarray(rand_image(56, 84, seed=s)) for s in (1, 2))
    cases = [
        (_chat_text(tok, 1, 0, "What is this?"), [img_a]),
        (_chat_text(tok, 2, 0, "Compare them."), [img_a, img_b]),
        (_chat_text(tok, 0, 0, "Hello there"), []),
    ]
    expected = [hf.greedy(text, imgs) for text, imgs in cases]
    llm = LLM(qwen2_vl_dir, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=8, tensor_parallel_size=2)
    try:
        prompts = [{"prompt": text, "multi_modal_data": {"image": imgs}} for text, imgs in cases]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(), use_tqdm=False)]
        assert got == expected
        assert expected[0] != expected[2]
        m = llm.get_metrics()
        assert m["vlserve:encoder_runs_total"] == 2  # img_a once (cached for the second prompt), img_b once
        llm.check_integrity()
    finally:
        llm.shutdown()
