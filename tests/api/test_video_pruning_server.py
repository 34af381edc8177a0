"""Video pruning over HTTP with the openai client on a tiny Qwen2-VL server started with --video-pruning-rate 0.5:
a request's `video_pruning_rate` overrides the server's, a bad one is a 400 naming the field."""

from __future__ import annotations

import openai
import pytest

from tests.api.test_api_media import data_url, mp4_bytes

ENGINE_KW = dict(dtype="float32", max_model_len=2048, num_kv_blocks=512, block_size=16, max_num_seqs=8)
VIDEO = data_url(mp4_bytes(seed=5, frames=8), "video/mp4")
MESSAGES = [
    {
        "role": "user",
        "content": [{"type": "video_url", "video_url": {"url": VIDEO}}, {"type": "text", "text": "what happens?"}],
    }
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.api.conftest import start_server
    from vlserve.config import EngineArgs
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    ckpt = build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("pruning_vl")))
    s = start_server(EngineArgs(model=ckpt, served_model_name="tiny-vl", video_pruning_rate=0.5, **ENGINE_KW))
    yield s
    s.close()


def chat(served, **extra):
    return served.client.chat.completions.create(
        model="tiny-vl",
        messages=MESSAGES,
        temperature=0,
        max_tokens=4,
        extra_body={"ignore_eos": True, **extra},
    )


def test_request_rate_overrides_the_server_rate(served):
    server_rate = chat(served)
    unpruned = chat(served, video_pruning_rate=0.0)
    again = chat(served, video_pruning_rate=0.5)
    more = chat(served, video_pruning_rate=0.75)
    assert again.usage.prompt_tokens == server_rate.usage.prompt_tokens
    assert again.choices[0].message.content == server_rate.choices[0].message.content
    assert more.usage.prompt_tokens < server_rate.usage.prompt_tokens < unpruned.usage.prompt_tokens
    assert all(r.usage.completion_tokens == 4 for r in (server_rate, unpruned, more))
    served.wait_idle()
    served.engine.engine.check_integrity()


@pytest.mark.parametrize("bad", [1.0, -0.25, 2, "half"])
def test_bad_rate_is_a_400_naming_the_field(served, bad):
    with pytest.raises(openai.BadRequestError) as info:
        chat(served, video_pruning_rate=bad)
    assert info.value.status_code == 400
    assert "video_pruning_rate" in str(info.value)
