"""Chat templates as real checkpoints ship them: Qwen2-VL's (content parts recognised by type 'image'/'video' or an
'image'/'video' key) and string-only ones. LLM.chat and the server must be token-exact with HF's processor + generate.
"""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from tests.multimodal.mm_media import encode_video, rand_image, rand_video
from tests.multimodal.test_mm_engine_parity import MAX_NEW, HFOracle
from tests.support.chat_templates import QWEN2_VL_CHAT_TEMPLATE, STRING_CHAT_TEMPLATE
from vlserve import LLM, SamplingParams
from vlserve.multimodal.media import load_video

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

VISION = {
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
}


def _greedy(n=MAX_NEW):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _png_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _img(h, w, seed):
    return Image.fromarray(rand_image(h, w, seed=seed))


def _to_hf(messages: list[dict]) -> list[dict]:
    """The same conversation the way HF's processor docs write it ({"type": "image"} parts, media passed apart)."""
    kinds = {"image_url": "image", "image_pil": "image", "video": "video", "video_url": "video"}
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [{"type": kinds[p["type"]]} if p["type"] in kinds else p for p in content]
        out.append({"role": m["role"], "content": content})
    return out


def _cases():
    """(name, vlserve messages, images, videos) for what a user tries first."""
    a, b, small = _img(56, 84, 1), _img(56, 56, 2), _img(28, 28, 3)
    frames = rand_video(4, 84, 84, seed=4)
    text = lambda s: {"type": "text", "text": s}  # noqa: E731
    return [
        (
            "one image",
            [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": _png_url(a)}}, text("What is this?")],
                }
            ],
            [a],
            [],
        ),
        (
            "one video",
            [{"role": "user", "content": [{"type": "video", "video": frames}, text("What happens?")]}],
            [],
            [frames],
        ),
        (
            "several images",
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_pil", "image_pil": a},
                        {"type": "image_pil", "image_pil": small},
                        text("Compare them."),
                    ],
                }
            ],
            [a, small],
            [],
        ),
        (
            "multi-turn",
            [
                {"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": [{"type": "image_pil", "image_pil": a}, text("Shape?")]},
                {"role": "assistant", "content": "A red circle."},
                {"role": "user", "content": [{"type": "image_pil", "image_pil": b}, text("And this?")]},
            ],
            [a, b],
            [],
        ),
    ]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def real_setup(request, tmp_path_factory):
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    path = build_qwen2_vl_checkpoint(
        str(tmp_path_factory.mktemp(f"real_{request.param}")),
        variant=request.param,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )
    return path, HFOracle(path), LLM(path, dtype="float32", num_kv_blocks=256)


def _hf_prompt_ids(hf: HFOracle, messages, images, videos, **kw) -> tuple[str, list[int]]:
    text = hf.processor.apply_chat_template(_to_hf(messages), add_generation_prompt=True, tokenize=False)
    ids = hf.processor(text=[text], images=images or None, videos=videos or None, return_tensors="pt", **kw)[
        "input_ids"
    ][0]
    return text, ids.tolist()


def test_chat_token_exact_with_hf(real_setup):
    _, hf, llm = real_setup
    cases = _cases()
    outs = llm.chat([msgs for _, msgs, _, _ in cases], _greedy(), use_tqdm=False)
    for (name, msgs, images, videos), out in zip(cases, outs):
        text, ids = _hf_prompt_ids(hf, msgs, images, videos)
        assert out.prompt == text, name
        assert out.prompt_token_ids == ids, name
        assert out.outputs[0].token_ids == hf.greedy(text, images, videos), name
    llm.check_integrity()


def test_image_url_part_gets_its_placeholder(real_setup):
    """The reported bug: {"type": "image_url"} handed to the template rendered nothing, and the request failed with
    "prompt has 0 image placeholder tokens"."""
    _, _, llm = real_setup
    url = _png_url(_img(56, 56, 5))
    processed = llm.input_processor.process_chat(
        [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe."}],
            }
        ]
    )
    assert processed.prompt.count(VISION["image"]) == 1
    assert len(processed.mm_features) == 1


def test_generate_with_images_wraps_in_real_template(real_setup):
    _, _, llm = real_setup
    img = _img(56, 56, 6)
    wrapped = llm.generate("Describe.", _greedy(), images=[img], use_tqdm=False)[0]
    chat = llm.chat(
        [{"role": "user", "content": [{"type": "image_pil", "image_pil": img}, {"type": "text", "text": "Describe."}]}],
        _greedy(),
        use_tqdm=False,
    )[0]
    assert wrapped.prompt_token_ids == chat.prompt_token_ids
    assert wrapped.outputs[0].token_ids == chat.outputs[0].token_ids


def test_string_only_template_gets_placeholders_in_front(real_setup):
    """A template that prints content as one string gets vLLM's rendering: placeholders, newline, text."""
    _, _, llm = real_setup
    a, b = _img(56, 56, 7), _img(28, 56, 8)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": a},
                {"type": "image_pil", "image_pil": b},
                {"type": "text", "text": "Compare."},
            ],
        }
    ]
    out = llm.chat(messages, _greedy(), use_tqdm=False, chat_template_kwargs={"chat_template": STRING_CHAT_TEMPLATE})
    expected = f"<|im_start|>user\n{VISION['image']}\n{VISION['image']}\nCompare.<|im_end|>\n<|im_start|>assistant\n"
    assert out[0].prompt == expected
    ref = llm.generate({"prompt": expected, "multi_modal_data": {"image": [a, b]}}, _greedy(), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids


def test_forced_content_format(real_setup):
    from vlserve.engine.input_processor import InputProcessor

    _, _, llm = real_setup
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_pil", "image_pil": _img(28, 28, 9)}, {"type": "text", "text": "Hi"}],
        }
    ]
    as_string = InputProcessor(llm.input_processor.loaded, chat_template_content_format="string")
    assert f"user\n{VISION['image']}\nHi<|im_end|>" in as_string.process_chat(messages).prompt
    as_parts = InputProcessor(llm.input_processor.loaded, chat_template_content_format="openai")
    assert f"user\n{VISION['image']}Hi<|im_end|>" in as_parts.process_chat(messages).prompt
    with pytest.raises(ValueError, match="chat_template_content_format"):
        InputProcessor(llm.input_processor.loaded, chat_template_content_format="parts")


def test_text_model_with_string_only_template(tmp_path):
    from transformers import AutoTokenizer

    from vlserve.demo.checkpoints import build_text_checkpoint

    path = build_text_checkpoint(str(tmp_path / "text"), arch="qwen2")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = STRING_CHAT_TEMPLATE
    tok.save_pretrained(path)
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    parts = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]},
    ]
    out = llm.chat(parts, _greedy(6), use_tqdm=False)[0]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello\nworld<|im_end|>\n<|im_start|>assistant\n"
    )
    assert out.prompt == expected
    assert out.prompt_token_ids == tok(expected, add_special_tokens=False)["input_ids"]
    ref = llm.generate(expected, _greedy(6), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    with pytest.raises(ValueError, match="image input was given to a text-only model"):
        llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": _img(28, 28, 1)}]}], use_tqdm=False)


@pytest.mark.slow
def test_server_token_exact_with_hf(real_setup, tmp_path):
    """/v1/chat/completions through the openai client on the real-template checkpoint: same prompt length as HF's
    processor and the same greedy text as HF generate, for one image, a video, several images and multi-turn."""
    from tests.api.conftest import start_server
    from vlserve.config import EngineArgs

    path, hf, llm = real_setup
    a, b = _img(56, 84, 11), _img(28, 28, 12)
    mp4 = encode_video(rand_video(4, 84, 84, seed=13))
    video = load_video(mp4)  # the frames both sides decode from the lossy clip
    mp4_url = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
    image = lambda img: {"type": "image_url", "image_url": {"url": _png_url(img)}}  # noqa: E731
    text = lambda s: {"type": "text", "text": s}  # noqa: E731
    cases = [
        ([{"role": "user", "content": [image(a), text("What is this?")]}], [a], [], {}),
        (
            [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": mp4_url}}, text("What moves?")]}],
            [],
            [video.frames],
            {"fps": video.sampled_fps},
        ),
        ([{"role": "user", "content": [image(a), image(b), text("Compare.")]}], [a, b], [], {}),
        (
            [
                {"role": "user", "content": [image(a), text("Shape?")]},
                {"role": "assistant", "content": "A circle."},
                {"role": "user", "content": [image(b), text("And this?")]},
            ],
            [a, b],
            [],
            {},
        ),
    ]
    served = start_server(EngineArgs(model=path, dtype="float32", num_kv_blocks=256, served_model_name="real-vl"))
    try:
        for messages, images, videos, kw in cases:
            prompt, ids = _hf_prompt_ids(hf, messages, images, videos, **kw)
            expected = hf.greedy(prompt, images, videos, **kw)
            r = served.client.chat.completions.create(
                model="real-vl", messages=messages, temperature=0, max_tokens=MAX_NEW, extra_body={"ignore_eos": True}
            )
            assert r.usage.prompt_tokens == len(ids)
            offline = llm.chat(messages, _greedy(), use_tqdm=False)[0]
            assert offline.prompt_token_ids == ids and offline.outputs[0].token_ids == expected
            # same text as offline; HF's one-shot decode may end in U+FFFD where the stream holds back half a char
            assert r.choices[0].message.content == offline.outputs[0].text
            hf_text = hf.processor.tokenizer.decode(expected, skip_special_tokens=True)
            assert hf_text.rstrip("\ufffd") == offline.outputs[0].text.rstrip("\ufffd")
        served.wait_idle()
    finally:
        served.close()
