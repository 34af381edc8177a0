"""Qwen3-VL (dense): the tower and the interleaved M-RoPE tables against HF's modules, then greedy parity with HF
generate through LLM.generate / LLM.chat / the server for text, one image, two images, a video and an image with a
video; chunked prefill through image spans with forced preemption, prefix caching with images, the encoder cache,
n-gram speculation and tensor parallel 2."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tests.multimodal.mm_media import rand_image, rand_video
from tests.multimodal.mm_server import assert_server_image_parity
from tests.support.hf_oracle import HFImageTextOracle, data_url
from tests.support.qwen3_vl_checkpoints import trained_video_layout
from vlserve import LLM, SamplingParams

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

MAX_NEW = 8


@pytest.fixture(scope="module")
def q3_dir(tmp_path_factory):
    from tests.support.qwen3_vl_checkpoints import build_qwen3_vl_checkpoint

    return build_qwen3_vl_checkpoint(str(tmp_path_factory.mktemp("qwen3_vl")))


class Qwen3Oracle(HFImageTextOracle):
    """HF on the checkpoint, raw video frames at HF's default 24 fps, 5.x's video layout read as trained."""

    def __init__(self, model_dir: str):
        super().__init__(model_dir, MAX_NEW, vlserve_processor=False)

    def video_kwargs(self, videos: list) -> dict:
        from transformers.video_utils import VideoMetadata

        # what vlserve assumes for raw frames: indices 0..T-1 at HF's default 24 fps
        return {
            "video_metadata": [
                VideoMetadata(total_num_frames=len(v), fps=24.0, frames_indices=list(range(len(v)))) for v in videos
            ],
            "do_sample_frames": False,
        }

    def adjust(self, inputs):
        from transformers import BatchFeature

        tok = self.processor.tokenizer
        special = [
            tok.convert_tokens_to_ids(t)
            for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
        ]
        return BatchFeature(trained_video_layout(inputs, *special))


@pytest.fixture(scope="module")
def oracle(q3_dir):
    return Qwen3Oracle(q3_dir)


def _greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _cases(oracle):
    img_a, img_b = Image.fromarray(rand_image(70, 100, seed=1)), Image.fromarray(rand_image(70, 100, seed=2))
    img_small = Image.fromarray(rand_image(40, 36, seed=3))
    frames = rand_video(4, 64, 96, seed=4)
    return [
        ("one image", oracle.text(1, "What is this?"), [img_a], []),
        ("other image", oracle.text(1, "What is this?"), [img_b], []),
        ("two sizes", oracle.text(2, "Compare them."), [img_a, img_small], []),
        ("video", oracle.text(0, "What happens?", n_videos=1), [], [frames]),
        ("image+video", oracle.text(1, "Both?", n_videos=1), [img_b], [frames]),
        ("text only", oracle.text(0, "Hello there"), [], []),
    ]


def _run(llm, cases, sp=None):
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs, "video": vids}} for _, text, imgs, vids in cases]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp or _greedy(), use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(oracle):
    return [oracle.greedy(text, imgs, vids) for _, text, imgs, vids in _cases(oracle)]


def test_interleaved_mrope_tables_match_hf(q3_dir):
    from transformers import AutoConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from vlserve.kernels.rotary_ref import rotary_cos_sin
    from vlserve.models.layers import RotaryEmbedding

    cfg = AutoConfig.from_pretrained(q3_dir).text_config
    ours = RotaryEmbedding(cfg, max_positions=512, dtype=torch.float32)
    assert ours.mrope_interleaved
    positions = torch.randint(0, 500, (3, 40))  # [3, T], unequal axes
    hf_cos, hf_sin = Qwen3VLTextRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions[:, None])
    cos, sin = rotary_cos_sin(positions, ours.cos_cache, ours.sin_cache, ours.mrope_section, interleaved=True)
    half = cos.shape[1]
    assert torch.equal(cos, hf_cos[0, :, :half]) and torch.equal(sin, hf_sin[0, :, :half])
    plain, _ = rotary_cos_sin(positions, ours.cos_cache, ours.sin_cache, ours.mrope_section)
    assert not torch.equal(plain, cos)  # the layouts differ: the test can tell them apart


def test_tower_matches_hf_with_deepstack(oracle):
    from vlserve.encoders.qwen3_vl_vision import Qwen3VisionTower, qwen3_vl_tower_config

    hf_tower = oracle.model.model.visual
    ours = Qwen3VisionTower(qwen3_vl_tower_config(oracle.model.config.vision_config))
    ours.load_state_dict(hf_tower.state_dict(), strict=True)  # same names and shapes as the checkpoint
    imgs = [Image.fromarray(rand_image(70, 100, seed=1)), Image.fromarray(rand_image(40, 36, seed=3))]
    inputs = oracle.processor.image_processor(images=imgs, return_tensors="pt")
    with torch.no_grad():
        hf = hf_tower(inputs["pixel_values"].to(oracle.device), grid_thw=inputs["image_grid_thw"].to(oracle.device))
        got = ours.to(oracle.device)(inputs["pixel_values"], inputs["image_grid_thw"])  # [n, H * (1 + K)]
    if isinstance(hf, tuple):  # transformers 4.57: (merged, deepstack features)
        merged, deepstack = hf
    else:
        merged, deepstack = hf.pooler_output, hf.deepstack_features
    want = torch.cat([merged, *deepstack], dim=-1)
    assert ours.num_deepstack_levels == 2 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # 4.57 resamples positions in another order


def test_generate_and_chat_parity_with_hf(q3_dir, oracle, expected):
    llm = LLM(q3_dir, dtype="float32", num_kv_blocks=256)
    cases = _cases(oracle)
    got = _run(llm, cases)
    for (name, *_), g, e in zip(cases, got, expected):
        assert g == e, f"{name}: {g} vs HF {e}"
    assert expected[0] != expected[1], "different images must give different outputs"
    _, text, imgs, _ = cases[0]
    url = data_url(imgs[0])
    chat = llm.chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
        _greedy(),
        use_tqdm=False,
    )
    assert chat[0].outputs[0].token_ids == expected[0]
    llm.check_integrity()


@pytest.mark.slow
def test_chunked_prefill_8_with_forced_preemption(q3_dir, oracle, expected):
    # 8-token steps split every image's placeholder run; 6 blocks x 16 slots cannot hold the batch at once
    llm = LLM(
        q3_dir, dtype="float32", num_kv_blocks=6, block_size=16, max_num_batched_tokens=8, enable_prefix_caching=False
    )
    assert _run(llm, _cases(oracle)) == expected
    assert llm.get_metrics()["vlserve:num_preemptions_total"] > 0
    llm.check_integrity()


def test_prefix_caching_and_encoder_cache_with_images(q3_dir, oracle, expected):
    llm = LLM(q3_dir, dtype="float32", num_kv_blocks=128, block_size=16)
    cases = _cases(oracle)[:2]
    first = _run(llm, cases)
    again = _run(llm, cases)  # same images, same prompts: prefix blocks shared, nothing encoded again
    assert first == again == expected[:2]
    m = llm.get_metrics()
    assert m["vlserve:prefix_cache_hits_total"] > 0
    assert m["vlserve:encoder_runs_total"] == 2
    img = Image.fromarray(rand_image(70, 100, seed=11))
    outs = llm.generate([f"Question {i}?" for i in range(6)], _greedy(3), images=[[img]] * 6, use_tqdm=False)
    assert len(outs) == 6 and llm.get_metrics()["vlserve:encoder_runs_total"] == 3
    llm.check_integrity()


def test_ngram_speculation_keeps_greedy_output(q3_dir, oracle, expected):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(q3_dir, dtype="float32", num_kv_blocks=256, speculative_config=spec, max_num_batched_tokens=16)
    assert _run(llm, _cases(oracle)) == expected
    llm.check_integrity()


@pytest.mark.slow
def test_tensor_parallel_2_matches_hf(q3_dir, oracle, expected):
    llm = LLM(q3_dir, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=8, tensor_parallel_size=2)
    try:
        assert _run(llm, _cases(oracle)) == expected
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_server_image_url_parity_with_hf(q3_dir, oracle, expected):
    _, text, imgs, _ = _cases(oracle)[0]
    assert_server_image_parity(
        q3_dir,
        imgs[0],
        expected[0],
        oracle.processor.tokenizer,
        oracle.inputs(text, imgs)["input_ids"].shape[1],
        MAX_NEW,
        "tiny-qwen3-vl",
    )


def test_eagle_over_qwen3_vl_keeps_greedy_output(tmp_path_factory):
    # One decoder layer with a zero attention output: a draft copying that layer (which has no q/k norm) predicts
    # the target exactly on text rows, so drafts get accepted; on image rows the target adds DeepStack features
    # the draft never sees. Output must equal plain decoding either way.
    from tests.support.eagle_checkpoints import zero_attention_output
    from tests.support.qwen3_vl_checkpoints import build_qwen3_vl_checkpoint
    from vlserve.spec_decode.eagle_heads import build_eagle_checkpoint

    root = tmp_path_factory.mktemp("q3_eagle")
    target = build_qwen3_vl_checkpoint(str(root / "t"), num_layers=1, deepstack_visual_indexes=(0,))
    zero_attention_output(target)
    head = build_eagle_checkpoint(str(root / "h"), target, "eagle", "mimic")
    imgs = [[Image.fromarray(rand_image(64, 64 + 32 * s, seed=s))] for s in range(3)]
    prompts = ["red red red square square square red red red square", "one two one two one two", "Describe."]
    kw = {"dtype": "float32", "num_kv_blocks": 128, "max_num_batched_tokens": 16}
    base = LLM(target, **kw).generate(prompts, _greedy(16), images=imgs, use_tqdm=False)
    spec_llm = LLM(target, speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": 3}, **kw)
    spec = spec_llm.generate(prompts, _greedy(16), images=imgs, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    assert spec_llm.get_metrics()["vlserve:spec_decode_num_accepted_tokens_total"] > 0
    spec_llm.check_integrity()
