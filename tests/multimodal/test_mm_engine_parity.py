"""End to end through LLM: Qwen2-VL / Qwen2.5-VL greedy parity with HF generate, encoder-cache behaviour, bad media."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from tests.multimodal.mm_media import encode_video, rand_image, rand_video
from vlserve import LLM, SamplingParams
from vlserve.multimodal.media import load_video

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

MAX_NEW = 10


def _chat_text(tok, n_images: int, n_videos: int, question: str) -> str:
    parts = [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos + [{"type": "text", "text": question}]
    return tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True)


class HFOracle:
    """HF AutoProcessor + AutoModelForImageTextToText greedy generate on the same checkpoint (float32)."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir)
        # the device LLM(device="auto") picks, so a CUDA run compares like with like
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval().to(self.device)

    def greedy(self, text: str, images=None, videos=None, n: int = MAX_NEW, **processor_kwargs) -> list[int]:
        from tests.support.hf_generate import align_hf_video_inputs, hf_greedy_ignoring_eos

        inputs = self.processor(
            text=[text], images=images or None, videos=videos or None, return_tensors="pt", **processor_kwargs
        ).to(self.device)
        skip = align_hf_video_inputs(inputs, processor_kwargs.get("fps"), self.model.config)
        if skip:
            pytest.skip(skip)
        out = hf_greedy_ignoring_eos(self.model, inputs, n)
        return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.fixture(scope="module")
def setup(vl_dir):
    return vl_dir, HFOracle(vl_dir), LLM(vl_dir, dtype="float32", num_kv_blocks=256)


def _greedy(n=MAX_NEW):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _case_prompts(tok):
    img_a = Image.fromarray(rand_image(56, 84, seed=1))
    img_b = Image.fromarray(rand_image(56, 84, seed=2))
    img_small = Image.fromarray(rand_image(28, 28, seed=3))
    frames = rand_video(4, 84, 84, seed=4)
    return [
        ("one image", _chat_text(tok, 1, 0, "What is this?"), [img_a], []),
        ("other image", _chat_text(tok, 1, 0, "What is this?"), [img_b], []),
        ("two sizes", _chat_text(tok, 2, 0, "Compare them."), [img_a, img_small], []),
        ("video", _chat_text(tok, 0, 1, "What happens?"), [], [frames]),
        ("image+video", _chat_text(tok, 1, 1, "Both?"), [img_b], [frames]),
        ("text only", _chat_text(tok, 0, 0, "Hello there"), [], []),
    ]


def _run_llm(llm, cases):
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs, "video": vids}} for _, text, imgs, vids in cases]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(), use_tqdm=False)]


def test_batch_parity_with_hf(setup):
    model_dir, hf, llm = setup
    cases = _case_prompts(llm.get_tokenizer())
    expected = [hf.greedy(text, imgs, vids) for _, text, imgs, vids in cases]
    got = _run_llm(llm, cases)
    for (name, *_), g, e in zip(cases, got, expected):
        assert g == e, f"{name}: {g} vs HF {e}"
    assert expected[0] != expected[1], "different images must give different outputs"
    llm.check_integrity()


def test_chunked_placeholder_runs_and_tiny_encoder_cache(setup, vl_dir):
    _, hf, llm = setup
    cases = _case_prompts(llm.get_tokenizer())
    expected = [hf.greedy(text, imgs, vids) for _, text, imgs, vids in cases]
    proc = llm.input_processor.mm_processor
    tok = llm.get_tokenizer()
    sizes = [f.length for _, text, imgs, vids in cases for f in proc.process(tok(text)["input_ids"], imgs, vids)[1]]
    assert max(sizes) > 4 and len(sizes) >= 5
    # 4-token steps split every placeholder run; a cache the size of the largest item holds one item at a time,
    # so entries are evicted and recomputed.
    small = LLM(
        vl_dir,
        dtype="float32",
        num_kv_blocks=256,
        max_num_batched_tokens=4,
        encoder_cache_size=max(sizes),
        enable_prefix_caching=False,
    )
    assert _run_llm(small, cases) == expected
    assert _run_llm(small, cases) == expected  # a second pass re-encodes what was evicted
    m = small.get_metrics()
    assert m["vlserve:encoder_cache_evictions_total"] > 0
    small.check_integrity()


def test_video_from_mp4_bytes_matches_frames(setup):
    _, hf, llm = setup
    frames = rand_video(4, 84, 84, seed=9)
    mp4 = encode_video(frames)
    video = load_video(mp4)  # what vlserve feeds the processor; lossy codec, so compare on these frames
    text = _chat_text(llm.get_tokenizer(), 0, 1, "What moves?")
    expected = hf.greedy(text, videos=[video.frames], fps=video.sampled_fps)
    out = llm.generate({"prompt": text, "multi_modal_data": {"video": mp4}}, _greedy(), use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected


def test_chat_api_matches_generate(setup):
    _, _, llm = setup
    img = Image.fromarray(rand_image(56, 56, seed=5))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    import base64

    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    chat = llm.chat(
        [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe."}],
            }
        ],
        _greedy(),
        use_tqdm=False,
    )
    pil = llm.chat(
        [{"role": "user", "content": [{"type": "image_pil", "image_pil": img}, {"type": "text", "text": "Describe."}]}],
        _greedy(),
        use_tqdm=False,
    )
    wrapped = llm.generate("Describe.", _greedy(), images=[img], use_tqdm=False)
    assert chat[0].outputs[0].token_ids == pil[0].outputs[0].token_ids == wrapped[0].outputs[0].token_ids


def test_one_image_many_requests_encodes_once(vl_dir):
    llm = LLM(vl_dir, dtype="float32", num_kv_blocks=256)
    img = Image.fromarray(rand_image(56, 56, seed=6))
    outs = llm.generate([f"Question {i}?" for i in range(10)], _greedy(4), images=[[img]] * 10, use_tqdm=False)
    assert len(outs) == 10
    m = llm.get_metrics()
    assert m["vlserve:encoder_runs_total"] == 1
    assert m["vlserve:encoder_cache_misses_total"] == 1
    assert m["vlserve:encoder_cache_hits_total"] >= 1  # KV prefix hits skip most; the rest hit the cache
    assert m["vlserve:mm_processor_cache_hits_total"] == 9
    llm.check_integrity()


def test_same_image_twice_in_one_prompt_encoded_once(vl_dir):
    llm = LLM(vl_dir, dtype="float32", num_kv_blocks=256)
    img = rand_image(56, 56, seed=7)
    llm.generate("Same twice?", _greedy(3), images=[[img, img.copy()]], use_tqdm=False)
    assert llm.get_metrics()["vlserve:encoder_runs_total"] == 1


def _bad_png_bytes():
    buf = io.BytesIO()
    Image.fromarray(rand_image(32, 32)).save(buf, format="PNG")
    return buf.getvalue()[:60]


@pytest.mark.parametrize(
    "item,match",
    [
        (b"definitely not an image", "image"),
        (None, "truncated"),
        (np.zeros((0, 10, 3), dtype=np.uint8), "image"),
    ],
)
def test_bad_images_rejected_and_engine_continues(setup, item, match):
    _, _, llm = setup
    if item is None:
        item = _bad_png_bytes()
    with pytest.raises(ValueError):
        llm.generate("Look.", _greedy(2), images=[[item]], use_tqdm=False)
    llm.check_integrity()
    assert len(llm.generate("Look.", _greedy(2), images=[[rand_image(28, 28)]], use_tqdm=False)) == 1


def test_decompression_bomb_rejected(setup):
    _, _, llm = setup
    buf = io.BytesIO()
    Image.new("L", (9000, 9000)).save(buf, format="PNG")  # 81 MP > the 64 MP cap
    with pytest.raises(ValueError, match="pixel"):
        llm.generate("Big.", _greedy(2), images=[[buf.getvalue()]], use_tqdm=False)


@pytest.mark.parametrize("mode", ["CMYK", "P", "RGBA", "L"])
def test_unusual_modes_are_converted(setup, mode):
    _, _, llm = setup
    img = Image.fromarray(rand_image(28, 28, seed=8)).convert(mode)
    out = llm.generate("Mode?", _greedy(2), images=[[img]], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_limits_and_mismatches(vl_dir):
    llm = LLM(vl_dir, dtype="float32", num_kv_blocks=128, limit_mm_per_prompt={"image": 1})
    tok = llm.get_tokenizer()
    img = rand_image(28, 28)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        llm.generate("Two?", _greedy(2), images=[[img, img]], use_tqdm=False)
    with pytest.raises(ValueError):  # one placeholder, no image? -> the text is used as is; two images, one slot
        llm.generate(
            {"prompt": _chat_text(tok, 1, 0, "x"), "multi_modal_data": {"video": [rand_video(2, 28, 28)]}},
            _greedy(2),
            use_tqdm=False,
        )
    with pytest.raises(ValueError, match="frames"):
        llm.generate("Empty video.", _greedy(2), videos=[[np.zeros((0, 28, 28, 3), dtype=np.uint8)]], use_tqdm=False)
    llm.check_integrity()
    assert not llm.engine.has_unfinished_requests()
