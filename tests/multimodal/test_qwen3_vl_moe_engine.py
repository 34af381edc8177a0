"""Qwen3-VL-MoE through the engine: prefix caching with the encoder cache (same image prompts twice: identical
outputs equal to HF greedy, prefix hits, no new encoder runs; one image in six prompts: encoded once), chunked
prefill through image spans with forced preemption, and the OpenAI server with an image_url data URL, each against
HF generate on the tiny MoE checkpoint of test_qwen3_vl_moe."""

from __future__ import annotations

import pytest
from PIL import Image

from tests.multimodal.mm_media import rand_image
from tests.multimodal.mm_server import assert_server_image_parity
from tests.multimodal.test_qwen3_vl import MAX_NEW, Qwen3Oracle, _cases, _greedy, _run
from tests.multimodal.test_qwen3_vl_moe import MOE
from vlserve import LLM

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from tests.support.qwen3_vl_checkpoints import build_qwen3_vl_checkpoint

    return build_qwen3_vl_checkpoint(str(tmp_path_factory.mktemp("qwen3_vl_moe_engine")), moe=MOE)


@pytest.fixture(scope="module")
def oracle(moe_dir):
    return Qwen3Oracle(moe_dir)


def _image_cases(oracle):
    """test_qwen3_vl's cases without the videos: one image, another image, two sizes, text only."""
    return [c for c in _cases(oracle) if not c[3]]


@pytest.fixture(scope="module")
def expected(oracle):
    return [oracle.greedy(text, imgs, vids) for _, text, imgs, vids in _image_cases(oracle)]


def test_prefix_caching_and_encoder_cache(moe_dir, oracle, expected):
    llm = LLM(moe_dir, dtype="float32", num_kv_blocks=128, block_size=16)
    cases = _image_cases(oracle)[:2]
    first = _run(llm, cases)
    runs = llm.get_metrics()["vlserve:encoder_runs_total"]
    again = _run(llm, cases)  # same images, same prompts: prefix blocks shared, nothing encoded again
    assert first == again == expected[:2]
    assert expected[0] != expected[1], "different images must give different outputs"
    m = llm.get_metrics()
    assert m["vlserve:prefix_cache_hits_total"] > 0
    assert runs == m["vlserve:encoder_runs_total"] == 2
    img = Image.fromarray(rand_image(70, 100, seed=11))
    outs = llm.generate([f"Question {i}?" for i in range(6)], _greedy(3), images=[[img]] * 6, use_tqdm=False)
    assert len(outs) == 6 and llm.get_metrics()["vlserve:encoder_runs_total"] == 3  # the same image: once
    llm.check_integrity()


def test_chunked_prefill_8_with_forced_preemption(moe_dir, oracle, expected):
    # 8-token steps split every image's placeholder run; 4 blocks x 16 slots cannot hold the batch at once (6 do
    # for these image prompts; test_qwen3_vl_moe's slow test runs the longer video cases with 6)
    llm = LLM(
        moe_dir, dtype="float32", num_kv_blocks=4, block_size=16, max_num_batched_tokens=8, enable_prefix_caching=False
    )
    assert _run(llm, _image_cases(oracle)) == expected
    assert llm.get_metrics()["vlserve:num_preemptions_total"] > 0
    llm.check_integrity()


def test_server_image_url_parity_with_hf(moe_dir, oracle, expected):
    _, text, imgs, _ = _image_cases(oracle)[0]
    assert_server_image_parity(
        moe_dir,
        imgs[0],
        expected[0],
        oracle.processor.tokenizer,
        oracle.inputs(text, imgs)["input_ids"].shape[1],
        MAX_NEW,
        "tiny-qwen3-vl-moe",
    )
