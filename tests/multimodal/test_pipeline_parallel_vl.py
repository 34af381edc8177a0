"""Vision-language models over two pipeline stages (gloo worker processes on this CPU): the first stage encodes the
images / video and merges their embeddings, the second receives hidden states only; every stage computes the
M-RoPE positions. Greedy token for token with HF and with PP=1 under chunked prefill that splits the placeholder
runs, and the encoder counters are the first stage's."""

from __future__ import annotations

import pytest
from PIL import Image

from tests.multimodal.mm_media import rand_image, rand_video
from tests.multimodal.test_mm_engine_parity import HFOracle, _chat_text, _greedy
from vlserve import LLM

pytestmark = [pytest.mark.slow, pytest.mark.hf_parity]


def _generate(llm, cases) -> list[list[int]]:
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs, "video": vids}} for text, imgs, vids in cases]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, _greedy(), use_tqdm=False)]


def test_qwen2_vl_pp2_matches_pp1_and_hf_on_images_and_video(qwen2_vl_dir):
    hf = HFOracle(qwen2_vl_dir)
    tok = hf.processor.tokenizer
    img_a, img_b = (Image.fromarray(rand_image(56, 84, seed=s)) for s in (1, 2))
    frames = rand_video(4, 84, 84, seed=4)
    cases = [
        (_chat_text(tok, 1, 0, "What is this?"), [img_a], []),
        (_chat_text(tok, 2, 0, "Compare them."), [img_a, img_b], []),
        (_chat_text(tok, 0, 1, "What happens?"), [], [frames]),
        (_chat_text(tok, 0, 0, "Hello there"), [], []),
    ]
    expected = [hf.greedy(text, imgs, vids) for text, imgs, vids in cases]
    one = LLM(qwen2_vl_dir, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=8)
    try:
        assert _generate(one, cases) == expected
    finally:
        one.shutdown()
    # 8-token steps split every placeholder run across steps (and so across the stages' hand-overs)
    llm = LLM(qwen2_vl_dir, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=8, pipeline_parallel_size=2)
    try:
        info = llm.engine.executor.collective_rpc("shard_info")
        assert [i["layers"] for i in info] == [(0, 1), (1, 2)]
        got = _generate(llm, cases)
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g == e, f"case {i} diverged under PP=2: {g} vs HF {e}"
        assert expected[0] != expected[3]
        m = llm.get_metrics()
        assert m["vlserve:encoder_runs_total"] == 3  # img_a once (cached for the second prompt), img_b, the video
        llm.check_integrity()
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    from vlserve.demo.llava_checkpoints import build_llava_checkpoint

    return build_llava_checkpoint(str(tmp_path_factory.mktemp("llava_pp")), num_layers=4)


def test_llava_pp2_matches_hf_with_chunked_prefill(llava_dir):
    from tests.multimodal.test_llava import HFOracle as LlavaOracle
    from tests.multimodal.test_llava import _img

    hf = LlavaOracle(llava_dir)
    cases = [
        (hf.chat_text(1, "What is this?"), [_img((40, 60), seed=0)], []),
        (hf.chat_text(2, "Compare them."), [_img((32, 400), seed=7), _img((40, 60), seed=0)], []),
        (hf.chat_text(0, "Hello there"), [], []),
    ]
    expected = [hf.greedy(text, imgs)[1] for text, imgs, _ in cases]
    llm = LLM(llava_dir, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16, pipeline_parallel_size=2)
    try:
        info = llm.engine.executor.collective_rpc("shard_info")
        assert [i["layers"] for i in info] == [(0, 2), (2, 4)]
        assert info[1]["num_params"] < info[0]["num_params"]  # no tower or projector on the second stage
        got = _generate(llm, cases)
        assert [g[: len(e)] for g, e in zip(got, expected)] == expected
        assert llm.get_metrics()["vlserve:encoder_runs_total"] == 2
        llm.check_integrity()
    finally:
        llm.shutdown()
