"""POST /v1/responses with audio on a tiny Qwen2-Audio: input_audio parts and an audio input_file give the chat
endpoint's greedy tokens for the same message."""

from __future__ import annotations

import pytest

from tests.api.test_api_audio import ENGINE_KW, data_url, input_audio, wav

ASK = "What do you hear?"


@pytest.fixture(scope="module")
def audio_server(tmp_path_factory):
    from tests.api.conftest import start_server
    from tests.support.audio_checkpoints import build_qwen2_audio_checkpoint
    from vlserve.config import EngineArgs

    path = build_qwen2_audio_checkpoint(str(tmp_path_factory.mktemp("responses_audio")))
    served = start_server(EngineArgs(model=path, served_model_name="tiny-audio", **ENGINE_KW))
    yield served
    served.close()


def test_audio_input_matches_chat(audio_server):
    clip = wav(1.0, seed=7)
    part = input_audio(clip)
    chat = audio_server.client.chat.completions.create(
        model=audio_server.model,
        messages=[{"role": "user", "content": [part, {"type": "text", "text": ASK}]}],
        max_tokens=8,
        temperature=0,
    )
    expected = chat.choices[0].message.content
    assert expected
    for audio_part in (part, {"type": "input_file", "file_data": data_url(clip), "filename": "clip.wav"}):
        r = audio_server.client.responses.create(
            model=audio_server.model,
            input=[{"role": "user", "content": [audio_part, {"type": "input_text", "text": ASK}]}],
            max_output_tokens=8,
            temperature=0,
        )
        assert r.output_text == expected and r.usage.input_tokens == chat.usage.prompt_tokens
