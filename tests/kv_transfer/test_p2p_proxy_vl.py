"""End to end (images): Qwen2-VL tiny behind `vlserve proxy`, a P2P producer and a P2P consumer server;
a chat request with an image_url data URL gives a plain server's greedy text, streamed or not, and the decode
server never processes media nor runs the vision tower (the producer's kv_transfer_params carry the expanded
prompt and the items without pixel data; the proxy strips the media parts from the decode server's messages)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from tests.kv_transfer.servers import metric as _metric
from tests.kv_transfer.servers import p2p_stack, streamed_chat
from tests.kv_transfer.servers import post as _post
from vlserve.api.disagg_proxy import _without_media


def _image_url(seed: int) -> str:
    img = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 56, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _msgs(seed: int) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": _image_url(seed)}},
                {"type": "text", "text": "What is in this picture? Describe it."},
            ],
        }
    ]


def test_without_media_keeps_text_parts_only():
    msgs = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:x"}}, {"type": "text", "text": "hi"}],
        },
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:y"}}]},
    ]
    assert _without_media(msgs) == [
        msgs[0],
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "user", "content": ""},
    ]


@pytest.fixture(scope="module")
def vl_stack(qwen2_vl_dir, mooncake):
    with p2p_stack(qwen2_vl_dir) as urls:
        yield urls


@pytest.mark.slow
def test_proxy_image_chat_equals_one_server_and_decode_never_sees_media(vl_stack):
    prod, cons, plain, proxy = vl_stack
    texts = []
    for seed in (1, 2):
        body = {"model": "tiny", "messages": _msgs(seed), "temperature": 0, "max_tokens": 10, "ignore_eos": True}
        want = _post(plain, "/v1/chat/completions", body)
        got = _post(proxy, "/v1/chat/completions", body)
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]  # the expanded prompt ran
        texts.append(want["choices"][0]["message"]["content"])
        assert streamed_chat(proxy, body) == want["choices"][0]["message"]["content"]
    assert texts[0] != texts[1]  # the image matters
    assert _metric(cons, "vlserve:kv_p2p_loaded_blocks_total") > 0
    assert _metric(cons, "vlserve:kv_p2p_failed_loads_total") == 0
    assert _metric(cons, "vlserve:encoder_runs_total") == 0  # the decode server never ran the tower
    assert _metric(cons, "vlserve:mm_processor_cache_misses_total") == 0  # nor processed any media
    assert _metric(prod, "vlserve:encoder_runs_total") > 0


@pytest.mark.slow
def test_proxy_video_chat_equals_one_server(vl_stack):
    """A video_url part (an mp4 data URL): sampled and encoded on the prefill server only."""
    from tests.multimodal.mm_media import encode_video, rand_video

    prod, cons, plain, proxy = vl_stack
    runs = _metric(cons, "vlserve:encoder_runs_total")
    url = "data:video/mp4;base64," + base64.b64encode(encode_video(rand_video(8, 56, 56, seed=5), fps=4)).decode()
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": url}},
                {"type": "text", "text": "What happens in the clip?"},
            ],
        }
    ]
    body = {"model": "tiny", "messages": msgs, "temperature": 0, "max_tokens": 10, "ignore_eos": True}
    want = _post(plain, "/v1/chat/completions", body)
    got = _post(proxy, "/v1/chat/completions", body)
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert _metric(cons, "vlserve:encoder_runs_total") == runs == 0
    assert _metric(cons, "vlserve:mm_processor_cache_misses_total") == 0
