"""InternVL (InternVL3 layout): the InternViT tower + pixel shuffle + projector against HF's modules, placeholder
expansion (`<img>` + tiles * `<IMG_CONTEXT>` + `</img>`) against InternVLProcessor for several tilings, then greedy
parity with HF generate through LLM.generate / LLM.chat / the server for text, one image and two images; chunked
prefill with forced preemption, prefix caching with the encoder cache, and tensor parallel 2. Videos (one tile and
one feature per frame, `FrameN: <img>...</img>` lines): prompt ids, greedy parity alone and after an image, and the
per-frame encoder cache."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tests.multimodal.mm_media import rand_image, rand_video
from tests.support.hf_oracle import HFImageTextOracle, data_url
from vlserve import LLM, SamplingParams

pytestmark = pytest.mark.hf_parity

MAX_NEW = 8
# (height, width) -> different tile grids: wide, tall, square, tiny, a long strip
SIZES = [(40, 60), (64, 200), (200, 64), (130, 130), (9, 13), (30, 400)]


def _img(size, seed):
    return Image.fromarray(rand_image(*size, seed=seed))


def _greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def ivl_dir(tmp_path_factory):
    from tests.support.internvl_checkpoints import build_internvl_checkpoint

    return build_internvl_checkpoint(str(tmp_path_factory.mktemp("internvl")))


class InternVLOracle(HFImageTextOracle):
    """The checkpoint's processor (the image processor vlserve serves with) + HF greedy generate (float32)."""

    def __init__(self, model_dir: str):
        super().__init__(model_dir, MAX_NEW)


@pytest.fixture(scope="module")
def oracle(ivl_dir):
    return InternVLOracle(ivl_dir)


def _cases(oracle):
    return [
        ("one image", oracle.text(1, "What is this?"), [_img(SIZES[0], seed=1)]),
        ("other image", oracle.text(1, "What is this?"), [_img(SIZES[3], seed=2)]),
        ("two images", oracle.text(2, "Compare them."), [_img(SIZES[1], seed=3), _img(SIZES[4], seed=4)]),
        ("text only", oracle.text(0, "Hello there"), []),
    ]


@pytest.fixture(scope="module")
def expected(oracle):
    return [oracle.run(text, imgs) for _, text, imgs in _cases(oracle)]


def _run(llm, cases):
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs}} for _, text, imgs in cases]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, _greedy(), use_tqdm=False)]


def _image_features(out):
    """get_image_features' [tiles, F, H] features: 5.x returns an output object (`.pooler_output`), 4.57 a plain
    tensor."""
    return out.pooler_output if hasattr(out, "pooler_output") else out


def test_tower_and_projector_match_hf(oracle):
    from vlserve.models.internvl import InternVLForConditionalGeneration

    hf = oracle.model.model
    ours = InternVLForConditionalGeneration(oracle.model.config)
    state = {k: v for k, v in hf.state_dict().items() if k.startswith(("vision_tower.", "multi_modal_projector."))}
    ours.load_weights(
        list(state.items())
        + [(f"model.language_model.{k}", v) for k, v in hf.language_model.state_dict().items()]
        + [("lm_head.weight", oracle.model.lm_head.weight)]
    )
    pixels = oracle.inputs("<IMG_CONTEXT><IMG_CONTEXT>", [_img(SIZES[0], seed=1), _img(SIZES[1], seed=2)])[
        "pixel_values"
    ]
    with torch.no_grad():
        want = _image_features(hf.get_image_features(pixel_values=pixels))  # [N, F, H]
        got = ours.to(oracle.device).tile_features(pixels)
    assert got.shape == want.shape == (pixels.shape[0], 4, oracle.model.config.text_config.hidden_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "variant",
    [
        dict(norm_type="rms_norm", use_qk_norm=True, attention_bias=False, use_mean_pooling=False),
        dict(norm_type="layer_norm", use_qk_norm=True, attention_bias=True, use_mean_pooling=True, depth=3),
    ],
)
def test_tower_variants_match_hf(variant):
    """RMSNorm / qk-norm / final LayerNorm towers (InternVL3's larger checkpoints) against HF InternVLVisionModel."""
    from transformers import InternVLVisionConfig, InternVLVisionModel

    from tests.support.internvl_checkpoints import internvl_vision_config, randomize_
    from vlserve.encoders.intern_vit import InternVitConfig, InternVitTower

    variant = dict(variant)
    cfg = InternVLVisionConfig(**internvl_vision_config(depth=variant.pop("depth", 2), **variant))
    torch.manual_seed(0)
    hf = InternVLVisionModel(cfg).eval()
    randomize_(hf, scale=0.3)
    ours = InternVitTower(InternVitConfig.from_hf(cfg))
    ours.load_state_dict(hf.state_dict(), strict=True)  # same names and shapes as the checkpoint
    pixels = torch.randn(3, 3, cfg.image_size[0], cfg.image_size[1])
    with torch.no_grad():
        want = hf(pixel_values=pixels).last_hidden_state
        got = ours(pixels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_placeholder_ids_match_hf_processor(ivl_dir, oracle):
    """Our expansion equals InternVLProcessor's input_ids for many tilings; max_image_embeds bounds them all."""
    from vlserve.multimodal.processor import MultiModalProcessor

    proc = MultiModalProcessor.from_pretrained(ivl_dir)
    hf = oracle.processor
    text = "Look: <IMG_CONTEXT>\nand <IMG_CONTEXT> done"
    counts = []
    for i, size in enumerate(SIZES + [(64, 64), (1, 1), (100, 7), (300, 301)]):
        imgs = [_img(size, seed=i), _img(SIZES[i % len(SIZES)], seed=i + 50)]
        ids, feats = proc.process(hf.tokenizer(text)["input_ids"], imgs)
        assert ids == hf(text=[text], images=imgs, return_tensors="pt")["input_ids"][0].tolist(), size
        for f in feats:
            assert set(ids[f.offset : f.end]) == {hf.image_token_id}
            assert ids[f.offset - 1] == hf.start_image_token_id and ids[f.end] == hf.end_image_token_id
        counts.append(feats[0].length)
    assert max(counts) <= proc.max_image_embeds()
    assert len(set(counts)) > 3  # the tile count follows size and aspect ratio


def test_generate_and_chat_parity_with_hf(ivl_dir, oracle, expected):
    llm = LLM(ivl_dir, dtype="float32", num_kv_blocks=256)
    cases = _cases(oracle)
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs}} for _, text, imgs in cases]
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    for (name, *_), out, (hf_prompt, hf_new) in zip(cases, outs, expected):
        assert out.prompt_token_ids == hf_prompt, f"{name}: placeholder expansion differs"
        assert list(out.outputs[0].token_ids) == hf_new, name
    assert expected[0][1] != expected[1][1], "different images must give different outputs"
    url = data_url(cases[0][2][0])
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
    assert list(chat[0].outputs[0].token_ids) == expected[0][1]
    llm.check_integrity()


def test_chunked_prefill_8_with_forced_preemption(ivl_dir, oracle, expected):
    # 8-token steps split every image's placeholder run; 6 blocks x 16 slots cannot hold the batch at once
    llm = LLM(
        ivl_dir, dtype="float32", num_kv_blocks=6, block_size=16, max_num_batched_tokens=8, enable_prefix_caching=False
    )
    assert _run(llm, _cases(oracle)) == [e[1] for e in expected]
    assert llm.get_metrics()["vlserve:num_preemptions_total"] > 0
    llm.check_integrity()


def test_prefix_caching_and_encoder_cache(ivl_dir, oracle, expected):
    llm = LLM(ivl_dir, dtype="float32", num_kv_blocks=128, block_size=16)
    cases = _cases(oracle)[:2]
    first = _run(llm, cases)
    again = _run(llm, cases)  # same images, same prompts: prefix blocks shared, nothing encoded again
    assert first == again == [e[1] for e in expected[:2]]
    m = llm.get_metrics()
    assert m["vlserve:prefix_cache_hits_total"] > 0
    assert m["vlserve:encoder_runs_total"] == 2
    img = _img((60, 90), seed=11)
    outs = llm.generate([f"Question {i}?" for i in range(6)], _greedy(3), images=[[img]] * 6, use_tqdm=False)
    assert len(outs) == 6 and llm.get_metrics()["vlserve:encoder_runs_total"] == 3
    llm.check_integrity()


@pytest.mark.slow
def test_tensor_parallel_2_matches_hf(ivl_dir, oracle, expected):
    llm = LLM(ivl_dir, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=8, tensor_parallel_size=2)
    try:
        assert _run(llm, _cases(oracle)) == [e[1] for e in expected]
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_server_image_url_parity_with_hf(ivl_dir, oracle, expected):
    from tests.api.conftest import start_server
    from vlserve.config import EngineArgs

    _, text, imgs = _cases(oracle)[0]
    served = start_server(
        EngineArgs(
            model=ivl_dir,
            served_model_name="tiny-internvl",
            dtype="float32",
            num_kv_blocks=128,
            max_num_batched_tokens=16,
        )
    )
    try:
        r = served.client.chat.completions.create(
            model="tiny-internvl",
            temperature=0,
            max_tokens=MAX_NEW,
            extra_body={"ignore_eos": True},
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url(imgs[0])}},
                        {"type": "text", "text": "What is this?"},
                    ],
                }
            ],
        )
        tok = oracle.processor.tokenizer
        # a stream ending inside a UTF-8 sequence holds that partial character back
        want = tok.decode(expected[0][1], skip_special_tokens=True).rstrip("\ufffd")
        assert r.choices[0].message.content.rstrip("\ufffd") == want and want
        assert r.usage.prompt_tokens == len(expected[0][0])
        served.wait_idle()
    finally:
        served.close()


# ---- videos -----------------------------------------------------------------------------------------------------


def _video_cases(oracle):
    """(name, prompt, images, videos): frames [T, H, W, 3] uint8 of several sizes (each resized to one tile)."""
    return [
        ("4-frame video", oracle.text(0, "What happens?", n_videos=1), [], [rand_video(4, 40, 50, seed=21)]),
        (
            "image + 3-frame video",
            oracle.text(1, "Compare them.", n_videos=1),
            [_img(SIZES[1], seed=22)],
            [rand_video(3, 70, 30, seed=23)],
        ),
    ]


@pytest.fixture(scope="module")
def video_expected(oracle):
    return [oracle.run(text, imgs, vids) for _, text, imgs, vids in _video_cases(oracle)]


def test_video_placeholder_ids_match_hf_processor(ivl_dir, oracle):
    """`<video>` -> `Frame1: <img>..</img>\\nFrame2: ..` as InternVLProcessor writes it, one feature per frame whose
    tile equals HF's pixel_values row; with and without an image, with text glued to the placeholder."""
    from vlserve.multimodal.processor import MultiModalProcessor

    proc = MultiModalProcessor.from_pretrained(ivl_dir)
    hf = oracle.processor
    cases = [(text, imgs, vids) for _, text, imgs, vids in _video_cases(oracle)] + [
        ("Look:<video> now", [], [rand_video(3, 20, 90, seed=24)]),
        ("(<video>\nthen<IMG_CONTEXT>", [_img(SIZES[5], seed=25)], [rand_video(4, 64, 64, seed=26)]),
    ]
    for text, imgs, vids in cases:
        ids, feats = proc.process(hf.tokenizer(text)["input_ids"], imgs, vids)
        out = oracle.inputs(text, imgs, vids)
        assert ids == out["input_ids"][0].tolist(), text
        frames = [f for f in feats if f.modality == "video"]
        assert len(frames) == len(vids[0]) and len({f.mm_hash for f in frames}) == len(frames)
        for f in frames:
            assert set(ids[f.offset : f.end]) == {hf.image_token_id} and f.length == hf.image_seq_length
            assert ids[f.offset - 1] == hf.start_image_token_id and ids[f.end] == hf.end_image_token_id
        pixels = torch.cat([f.data.get("pixel_values", f.data.get("pixel_values_videos")) for f in feats])
        torch.testing.assert_close(pixels, out["pixel_values"].cpu(), rtol=0, atol=0)  # items in prompt order
    assert proc.max_video_embeds(5) == 5 * hf.image_seq_length


def test_video_ids_not_from_text_are_kept(ivl_dir, oracle):
    """Prompt ids that are no tokenization of their text keep their tokens before the video's first frame."""
    from vlserve.multimodal.processor import MultiModalProcessor

    proc = MultiModalProcessor.from_pretrained(ivl_dir)
    tok = oracle.processor.tokenizer
    odd = [i for ch in "Frame" for i in tok(ch, add_special_tokens=False)["input_ids"]]  # spelled out, letter by letter
    assert odd != tok("Frame", add_special_tokens=False)["input_ids"]
    ids, feats = proc.process(odd + tok("<video>")["input_ids"], [], [rand_video(2, 40, 40, seed=27)])
    assert ids[: len(odd)] == odd and len(feats) == 2


def test_video_generate_parity_with_hf(ivl_dir, oracle, video_expected):
    llm = LLM(ivl_dir, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=16)
    cases = _video_cases(oracle)
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs, "video": vids}} for _, text, imgs, vids in cases]
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    for (name, *_), out, (hf_prompt, hf_new) in zip(cases, outs, video_expected):
        assert out.prompt_token_ids == hf_prompt, f"{name}: placeholder expansion differs"
        assert list(out.outputs[0].token_ids) == hf_new, name
    llm.check_integrity()


def test_video_frames_encoded_once(ivl_dir, oracle, video_expected):
    """The same video in two requests (prefix caching off): its frames are encoded in the first one only."""
    llm = LLM(ivl_dir, dtype="float32", num_kv_blocks=128, enable_prefix_caching=False)
    _, text, _, vids = _video_cases(oracle)[0]
    first = llm.generate([{"prompt": text, "multi_modal_data": {"video": vids}}], _greedy(), use_tqdm=False)
    other = oracle.text(0, "Describe the clip.", n_videos=1)
    llm.generate([{"prompt": other, "multi_modal_data": {"video": vids}}], _greedy(), use_tqdm=False)
    m = llm.get_metrics()
    assert list(first[0].outputs[0].token_ids) == video_expected[0][1]
    assert m["vlserve:encoder_runs_total"] == len(vids[0]) == 4
    assert m['vlserve:encoder_runs_by_modality_total{modality="video"}'] == 4
    assert m["vlserve:encoder_cache_hits_total"] >= 4
    llm.check_integrity()
