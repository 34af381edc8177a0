"""LLaVA-NeXT over HTTP: OpenAI `image_url` parts (data: URLs) through the openai client give what LLM.chat gives
offline; `--limit-mm-per-prompt` is a 400 naming the limit."""

from __future__ import annotations

import pytest

from tests.api.test_api_media import data_url, image_msg, png_bytes
from vlserve import LLM, SamplingParams

ENGINE_KW = dict(
    dtype="float32",
    max_model_len=1024,
    num_kv_blocks=128,
    block_size=16,
    max_num_seqs=8,
    limit_mm_per_prompt={"image": 2},
)


@pytest.fixture(scope="module")
def next_ckpt(tmp_path_factory) -> str:
    from vlserve.demo.llava_checkpoints import build_llava_checkpoint

    return build_llava_checkpoint(str(tmp_path_factory.mktemp("api_llava_next")), variant="llava_next")


@pytest.fixture(scope="module")
def next_server(next_ckpt):
    from tests.api.conftest import start_server
    from vlserve.config import EngineArgs

    served = start_server(EngineArgs(model=next_ckpt, served_model_name="tiny-llava", **ENGINE_KW))
    yield served
    served.close()


def test_image_url_parts_match_offline_chat(next_server, next_ckpt):
    wide, tall = data_url(png_bytes(1, size=(400, 32))), data_url(png_bytes(2, size=(30, 90)))
    offline = LLM(next_ckpt, **ENGINE_KW)
    for urls in ((wide,), (wide, tall)):
        reply = next_server.client.chat.completions.create(
            model="tiny-llava", messages=image_msg(*urls), temperature=0, max_tokens=8, extra_body={"ignore_eos": True}
        )
        want = offline.chat(
            image_msg(*urls), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )[0]
        assert reply.choices[0].message.content == want.outputs[0].text
        assert reply.usage.prompt_tokens == len(want.prompt_token_ids)
    r = next_server.http.post(
        "/v1/chat/completions", json={"model": "tiny-llava", "max_tokens": 2, "messages": image_msg(wide, tall, wide)}
    )
    assert r.status_code == 400 and "--limit-mm-per-prompt" in r.json()["error"]["message"]
    next_server.wait_idle()
