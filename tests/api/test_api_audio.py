"""Qwen2-Audio over HTTP with the official openai client: input_audio and audio_url parts (data:, file://, http)
give HF's greedy tokens, streamed and not; one clip in 8 requests runs the encoder once (/metrics); bad audio is a
400 with OpenAI-style error JSON, nothing leaked, and the server answers correctly afterwards."""

from __future__ import annotations

import base64
import io
import os
import wave

import pytest

from tests.api.conftest import http_file_server
from tests.multimodal.audio_hf import HFAudioOracle, chat_text
from tests.multimodal.audio_media import encode_audio, tones

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

MAX_NEW = 8
NO_EOS = {"ignore_eos": True}
ENGINE_KW = dict(
    dtype="float32",
    max_model_len=1024,
    num_kv_blocks=256,
    block_size=16,
    max_num_seqs=16,
    limit_mm_per_prompt={"audio": 2},
    max_audio_seconds=5.0,
)


def wav(seconds: float, seed: int, rate: int = 16000, channels: int = 1) -> bytes:
    return encode_audio(tones(seconds, rate, channels=channels, seed=seed), rate, "wav")


def empty_wav() -> bytes:
    """A valid WAV header with no frames (PyAV writes nothing at all for zero samples)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
    return buf.getvalue()


def input_audio(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def audio_url(url: str) -> dict:
    return {"type": "audio_url", "audio_url": {"url": url}}


def data_url(data: bytes, mime: str = "audio/wav") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def user(*parts: dict, text: str = "What do you hear?") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def audio_ckpt(tmp_path_factory) -> str:
    from tests.support.audio_checkpoints import build_qwen2_audio_checkpoint

    return build_qwen2_audio_checkpoint(str(tmp_path_factory.mktemp("api_audio")))


@pytest.fixture(scope="module")
def oracle(audio_ckpt):
    return HFAudioOracle(audio_ckpt)


@pytest.fixture(scope="module")
def audio_http():
    """127.0.0.1 http.server with one wav clip and one file that is not audio."""
    files = {"/clip.wav": wav(1.0, seed=31), "/junk.wav": b"definitely not a wav file" * 4}

    with http_file_server(files) as base:
        yield base, files


@pytest.fixture(scope="module")
def audio_server(audio_ckpt, media_dir):
    from tests.api.conftest import start_server
    from vlserve.api.media import MediaConfig
    from vlserve.config import EngineArgs

    media = MediaConfig(allowed_local_media_path=media_dir, allowed_media_domains=["127.0.0.1"])
    served = start_server(EngineArgs(model=audio_ckpt, served_model_name="tiny-audio", **ENGINE_KW), media=media)
    yield served
    served.close()


def ask(served, messages, stream: bool = False, max_tokens: int = MAX_NEW) -> str:
    kw = dict(model="tiny-audio", messages=messages, temperature=0, max_tokens=max_tokens, extra_body=NO_EOS)
    if not stream:
        r = served.client.chat.completions.create(**kw)
        assert r.usage.completion_tokens == max_tokens
        return r.choices[0].message.content
    chunks = served.client.chat.completions.create(**kw, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def hf_text(oracle, turns, clips) -> str:
    tok = oracle.processor.tokenizer
    return tok.decode(oracle.greedy(chat_text(tok, turns), clips), skip_special_tokens=True)


def test_openai_client_matches_hf(audio_server, oracle, audio_http, media_dir):
    base, files = audio_http
    one = wav(1.0, seed=31)  # the clip audio_http serves
    stereo = wav(2.5, seed=32, rate=44100, channels=2)
    with open(os.path.join(media_dir, "clip one.wav"), "wb") as f:
        f.write(one)
    expected = hf_text(oracle, [("user", (1, "What do you hear?"))], [one])
    for part in (
        input_audio(one),
        audio_url(data_url(one)),
        audio_url(f"file://{media_dir}/clip%20one.wav"),
        audio_url(f"{base}/clip.wav"),
    ):
        assert ask(audio_server, user(part)) == expected, part["type"]
    assert ask(audio_server, user(input_audio(one)), stream=True) == expected

    two = user(input_audio(stereo), audio_url(data_url(one)), text="Which is longer?")
    expected_two = hf_text(oracle, [("user", (2, "Which is longer?"))], [stereo, one])
    assert ask(audio_server, two) == expected_two == ask(audio_server, two, stream=True)

    follow_up = user(input_audio(stereo)) + [
        {"role": "assistant", "content": "A chord."},
        {"role": "user", "content": "How many notes?"},
    ]
    turns = [("user", (1, "What do you hear?")), ("assistant", "A chord."), ("user", (0, "How many notes?"))]
    assert ask(audio_server, follow_up) == hf_text(oracle, turns, [stereo])
    audio_server.wait_idle()
    audio_server.engine.engine.check_integrity()


def test_one_clip_in_eight_requests_one_encoder_run(audio_server):
    from concurrent.futures import ThreadPoolExecutor

    def counts() -> tuple[float, float]:
        m = audio_server.metrics_labelled()
        return (
            m['vlserve:encoder_runs_by_modality_total{modality="audio"}'],
            m['vlserve:encoder_cache_hits_by_modality_total{modality="audio"}'],
        )

    runs, hits = counts()
    clip = wav(1.5, seed=33, rate=22050, channels=2)
    with ThreadPoolExecutor(8) as pool:
        texts = list(
            pool.map(
                lambda i: ask(audio_server, user(input_audio(clip), text=f"Question {i}?"), max_tokens=2), range(8)
            )
        )
    assert all(texts)
    assert counts() == (runs + 1, hits + 7)
    audio_server.wait_idle()
    audio_server.engine.engine.check_integrity()


def post(served, messages) -> tuple[int, dict]:
    r = served.http.post("/v1/chat/completions", json={"model": "tiny-audio", "messages": messages, "max_tokens": 2})
    return r.status_code, r.json().get("error") or {}


def test_bad_audio_is_a_400_and_leaves_nothing(audio_server, oracle, audio_http, media_dir, tmp_path):
    base, _ = audio_http
    outside = tmp_path / "outside.wav"
    outside.write_bytes(wav(0.5, seed=34))
    one = wav(0.5, seed=35)
    huge_b64 = "QUFB" * 20000
    cases = [
        (user(input_audio(b"RIFF\x00\x00 garbage, not audio" * 4)), "could not decode audio"),
        (user({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}), "empty audio"),
        (user(input_audio(empty_wav())), "no decodable samples"),
        (user(input_audio(one, fmt="aiff")), "input_audio.format 'aiff' is not supported"),
        (user({"type": "input_audio", "input_audio": {"format": "wav"}}), "needs {'data'"),
        (user({"type": "input_audio", "input_audio": {"data": "!!not base64!!", "format": "wav"}}), "base64"),
        (user({"type": "input_audio", "input_audio": {"data": huge_b64, "format": "mp3"}}), "could not decode"),
        (user(input_audio(wav(6.0, seed=36))), "the 5 s limit"),
        (user(*[input_audio(one)] * 3), "3 audio items exceed the limit of 2"),
        (user(audio_url(data_url(b"\x89PNG\r\n\x1a\n", "image/png"))), "audio"),
        (user(audio_url(f"file://{outside}")), "outside --allowed-local-media-path"),
        (user(audio_url(f"{base}/missing.wav")), "404"),
        (user(audio_url(f"{base}/junk.wav")), "could not decode audio"),
    ]
    for messages, words in cases:
        status, err = post(audio_server, messages)
        assert status == 400 and set(err) == {"message", "type", "param", "code"}, (words, status, err)
        assert words in err["message"] and len(err["message"]) < 600, (words, err["message"])
    audio_server.wait_idle()
    audio_server.engine.engine.check_integrity()  # no KV block or encoder-cache reference left behind
    assert audio_server.http.get("/health").status_code == 200
    expected = hf_text(oracle, [("user", (1, "What do you hear?"))], [one])
    assert ask(audio_server, user(input_audio(one))) == expected
