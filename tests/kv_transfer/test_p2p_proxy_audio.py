"""End to end (audio): Qwen2-Audio tiny behind `vlserve proxy`, a P2P producer and a P2P consumer server
that drafts with n-gram; an input_audio chat gives a plain server's greedy text, and the decode server never
decodes the clip nor runs the audio tower."""

from __future__ import annotations

import base64
import json

import pytest

from tests.kv_transfer.servers import metric as _metric
from tests.kv_transfer.servers import p2p_stack
from tests.kv_transfer.servers import post as _post
from tests.multimodal.audio_media import encode_audio, tones

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory):
    from tests.support.audio_checkpoints import build_qwen2_audio_checkpoint

    return build_qwen2_audio_checkpoint(str(tmp_path_factory.mktemp("proxy_audio")), num_layers=1)


@pytest.fixture(scope="module")
def audio_stack(audio_dir, mooncake):
    with p2p_stack(audio_dir, ("--speculative-config", json.dumps(NGRAM))) as urls:
        yield urls


@pytest.mark.slow
def test_proxy_audio_chat_equals_one_server(audio_stack):
    prod, cons, plain, proxy = audio_stack
    texts = []
    for seed in (1, 2):
        wav = encode_audio(tones(1.0, seed=seed), 16000, "wav")
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
        msgs = [{"role": "user", "content": [part, {"type": "text", "text": "beep beep beep beep"}]}]
        body = {"model": "tiny", "messages": msgs, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
        want = _post(plain, "/v1/chat/completions", body)
        got = _post(proxy, "/v1/chat/completions", body)
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
        texts.append(want["choices"][0]["message"]["content"])
    assert texts[0] != texts[1]  # the clip matters
    assert _metric(cons, "vlserve:encoder_runs_total") == 0
    assert _metric(cons, "vlserve:mm_processor_cache_misses_total") == 0
    assert _metric(cons, "vlserve:kv_p2p_loaded_blocks_total") > 0
    assert _metric(cons, "vlserve:spec_decode_num_draft_tokens_total") > 0
    assert _metric(prod, "vlserve:encoder_runs_total") == 2
