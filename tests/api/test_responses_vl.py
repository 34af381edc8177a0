"""POST /v1/responses with images on a tiny Qwen2-VL: input_image (data URL, any detail) and an image input_file
give the chat endpoint's greedy tokens for the same message, streamed or not; audio the model lacks is a 400."""

from __future__ import annotations

import openai
import pytest

from tests.api.test_api_media import VL_ENGINE_KW, data_url, png_bytes

PICTURE = data_url(png_bytes(3))
ASK = "What is in the picture?"


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    from tests.api.conftest import start_server
    from vlserve.config import EngineArgs
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    path = build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("responses_vl")))
    served = start_server(EngineArgs(model=path, served_model_name="tiny-vl", **VL_ENGINE_KW))
    yield served
    served.close()


def chat_reference(served) -> tuple[str, int]:
    content = [{"type": "image_url", "image_url": {"url": PICTURE}}, {"type": "text", "text": ASK}]
    r = served.client.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": content}], max_tokens=10, temperature=0
    )
    return r.choices[0].message.content, r.usage.prompt_tokens


@pytest.mark.parametrize(
    "image_part",
    [
        {"type": "input_image", "image_url": PICTURE},
        {"type": "input_image", "image_url": PICTURE, "detail": "low"},
        {"type": "input_file", "file_data": PICTURE, "filename": "picture.png"},
    ],
    ids=["input_image", "detail_low", "input_file"],
)
def test_image_input_matches_chat(vl_server, image_part):
    text, prompt_tokens = chat_reference(vl_server)
    item = {"role": "user", "content": [image_part, {"type": "input_text", "text": ASK}]}
    kw = dict(model=vl_server.model, input=[item], max_output_tokens=10, temperature=0)
    r = vl_server.client.responses.create(**kw)
    assert r.output_text == text and r.usage.input_tokens == prompt_tokens
    with vl_server.client.responses.stream(**kw) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert deltas == text


def test_audio_the_model_lacks_is_refused(vl_server):
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    with pytest.raises(openai.BadRequestError) as e:
        vl_server.client.responses.create(
            model=vl_server.model, input=[{"role": "user", "content": [audio]}], max_output_tokens=2
        )
    assert "audio" in str(e.value)
    assert vl_server.http.get("/health").status_code == 200


def test_media_settings_reach_the_input_side(vl_server):
    """mm_processor_kwargs shrink the image as on chat; a media_io_kwargs value over the server's bound is a 400
    naming it."""
    picture = data_url(png_bytes(5, size=(112, 112)))
    content = [{"type": "image_url", "image_url": {"url": picture}}, {"type": "text", "text": ASK}]
    small = {"max_pixels": 28 * 28 * 4}
    chat = vl_server.client.chat.completions.create(
        model=vl_server.model,
        messages=[{"role": "user", "content": content}],
        max_tokens=4,
        temperature=0,
        extra_body={"mm_processor_kwargs": small},
    )
    item = {
        "role": "user",
        "content": [{"type": "input_image", "image_url": picture}, {"type": "input_text", "text": ASK}],
    }
    r = vl_server.client.responses.create(
        model=vl_server.model,
        input=[item],
        max_output_tokens=4,
        temperature=0,
        extra_body={"mm_processor_kwargs": small},
    )
    full = vl_server.client.responses.create(model=vl_server.model, input=[item], max_output_tokens=1)
    assert r.usage.input_tokens == chat.usage.prompt_tokens < full.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as e:
        vl_server.client.responses.create(
            model=vl_server.model,
            input=[item],
            max_output_tokens=2,
            extra_body={"media_io_kwargs": {"video": {"num_frames": 100000}}},
        )
    assert "num_frames" in str(e.value)
    assert vl_server.http.get("/health").status_code == 200
