"""Hostile or odd requests: client-supplied templates, oversize input, out-of-range knobs, mismatched media, and
error messages that must neither leak internals nor echo huge values. Nothing may leak afterwards."""

from __future__ import annotations

import asyncio
import os
import threading

import httpx
import pytest

from tests.api.conftest import TEXT_ENGINE_KW, start_server
from tests.api.test_api_errors import assert_error_shape
from tests.api.test_api_media import data_url, png_bytes

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
MSG = [{"role": "user", "content": "hello"}]
# 1e8 iterations of the sandbox's range (capped at 1e5 per range): ~4 s of Jinja in an input worker here. (8e6 took
# only 0.4-0.6 s, so a fast request sent 0.3 s after it could lose the race to a hiccup: a flaky test.)
SLOW_TEMPLATE = (
    "{% for i in range(100000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
)


def chat(**kw):
    return {"model": "tiny-text", "messages": MSG, "max_tokens": 2, **kw}


@pytest.fixture(scope="module")
def trusting_server(text_ckpt):
    """A server that runs request-supplied chat templates, with a 1 MiB body cap."""
    from vlserve.config import EngineArgs

    served = start_server(
        EngineArgs(model=text_ckpt, served_model_name="tiny-text", **TEXT_ENGINE_KW),
        trust_request_chat_template=True,
        max_body_bytes=1 << 20,
    )
    yield served
    served.close()


# -- 1. client-supplied chat templates ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [
        chat(chat_template="{% for i in range(99999) %}x{% endfor %}"),
        chat(chat_template_kwargs={"chat_template": "{{ 'x' }}"}),
        chat(chat_template_kwargs={"my_template": "{{ 'x' }}"}),
    ],
    ids=["field", "kwarg", "template-like-kwarg"],
)
def test_request_chat_template_refused_by_default(server, body):
    assert_error_shape(server.http.post(CHAT, json=body), 400, "--trust-request-chat-template")


def test_plain_chat_template_kwargs_still_allowed(server):
    r = server.http.post(CHAT, json=chat(chat_template_kwargs={"add_vision_id": True}))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("key", ["tokenize", "return_tensors", "tools"])
def test_reserved_template_kwargs_refused_without_internals(server, key):
    r = server.http.post(CHAT, json=chat(chat_template_kwargs={key: True}))
    assert_error_shape(r, 400, f"chat_template_kwargs['{key}']")
    assert "transformers" not in r.text and "Union" not in r.text


def test_trusted_template_is_used(trusting_server, text_ckpt):
    from transformers import AutoTokenizer

    r = trusting_server.http.post(CHAT, json=chat(chat_template="{{ 'one two three' }}"))
    assert r.status_code == 200, r.text
    expected = len(AutoTokenizer.from_pretrained(text_ckpt)("one two three", add_special_tokens=False)["input_ids"])
    assert r.json()["usage"]["prompt_tokens"] == expected


@pytest.mark.slow
def test_slow_input_does_not_hold_up_a_fast_one(trusting_server):
    """A request stuck in preprocessing (seconds of template loop) must not delay one sent right after it."""
    finished: list[str] = []
    lock = threading.Lock()

    def send(name: str, body: dict) -> None:
        with httpx.Client(base_url=trusting_server.base_url, timeout=120, trust_env=False) as http:
            assert http.post(CHAT, json=body).status_code == 200
        with lock:
            finished.append(name)

    slow = threading.Thread(target=send, args=("slow", chat(chat_template=SLOW_TEMPLATE)))
    slow.start()
    threading.Event().wait(0.3)  # the slow one is in its template loop by now
    send("fast", chat())
    slow.join(120)
    assert finished == ["fast", "slow"]
    trusting_server.wait_idle()


# -- 2. early size limits -----------------------------------------------------------------------------------------
def test_huge_prompt_refused_before_tokenizing(server, monkeypatch):
    ip = server.engine.input_processor
    seen: list[int] = []
    real = ip.tokenizer

    class Counting:
        def __call__(self, text, **kw):
            seen.append(len(text))
            return real(text, **kw)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(ip, "tokenizer", Counting())
    big = "word " * 1_000_000  # 5 MB
    for path, body in (
        (COMPL, {"model": "tiny-text", "prompt": big}),
        (CHAT, chat(messages=[{"role": "user", "content": big}])),
    ):
        assert_error_shape(server.http.post(path, json=body), 400, "characters")
    assert all(n < ip.max_prompt_chars for n in seen), seen


def test_body_cap_applies_with_and_without_content_length(trusting_server):
    from vlserve.api.server import ServerConfig

    assert ServerConfig().max_body_bytes <= 64 << 20
    big = b'{"model": "tiny-text", "prompt": "' + b"x" * (2 << 20) + b'"}'
    headers = {"content-type": "application/json"}
    assert_error_shape(trusting_server.http.post(COMPL, content=big, headers=headers), 413, "cap")

    def chunks():
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    assert_error_shape(trusting_server.http.post(COMPL, content=chunks(), headers=headers), 413, "cap")
    ok = b'{"model": "tiny-text", "prompt": "hi", "max_tokens": 2}'
    assert trusting_server.http.post(COMPL, content=iter([ok[:10], ok[10:]]), headers=headers).status_code == 200


def test_mm_processor_kwargs_bounds():
    from vlserve.api.errors import APIError
    from vlserve.api.serving_base import MMKwargLimits, check_mm_processor_kwargs

    limits = MMKwargLimits(max_pixels=1000, max_frames=8)
    assert check_mm_processor_kwargs({"max_pixels": 1000, "min_pixels": 10, "fps": 1.5}, limits)
    for kwargs, words in [
        ({"max_pixels": 1001}, "at most 1000"),
        ({"min_pixels": 4_000_000}, "at most 1000"),
        ({"num_frames": 9}, "at most 8"),
        ({"min_pixels": 50, "max_pixels": 40}, "<="),
        ({"max_pixels": 10.5}, "integer"),
        ({"tokenize": True, "size": 1}, "'tokenize', 'size'"),
    ]:
        with pytest.raises(APIError) as e:
            check_mm_processor_kwargs(kwargs, limits)
        assert words in e.value.message and e.value.status == 400


# -- 3. limits vLLM enforces ---------------------------------------------------------------------------------------
def test_max_tokens_over_the_context_left_is_400(server):
    r = server.http.post(COMPL, json={"model": "tiny-text", "prompt": [5] * 1000, "max_tokens": 200})
    assert_error_shape(r, 400, "max_model_len")
    msg = r.json()["error"]["message"]
    assert "1024" in msg and "1000" in msg and "200" in msg and "at most 24" in msg
    assert r.json()["error"]["param"] == "max_tokens"
    ok = server.http.post(COMPL, json={"model": "tiny-text", "prompt": [5] * 1000, "max_tokens": 24})
    assert ok.status_code == 200, ok.text
    long_chat = chat(messages=[{"role": "user", "content": "a b " * 300}], max_completion_tokens=1000)
    r = server.http.post(CHAT, json=long_chat)
    assert_error_shape(r, 400, "max_completion_tokens is too large")  # the field the client sent
    assert r.json()["error"]["param"] == "max_completion_tokens"
    del long_chat["max_completion_tokens"]
    long_chat["max_tokens"] = 1000
    assert_error_shape(server.http.post(CHAT, json=long_chat), 400, "max_tokens is too large")


@pytest.mark.parametrize(
    "body,words",
    [
        (chat(messages=[{"role": "wizard", "content": "hi"}]), "role must be one of"),
        (chat(stop=[f"s{i}" for i in range(65)]), "at most 64"),
    ],
)
def test_roles_and_stop_count(server, body, words):
    assert_error_shape(server.http.post(CHAT, json=body), 400, words)


def test_python_api_applies_the_same_rules(offline_llm):
    from vlserve import SamplingParams

    with pytest.raises(ValueError, match="at most 64"):
        SamplingParams(stop=[str(i) for i in range(65)])
    with pytest.raises(ValueError, match="role must be one of"):
        offline_llm.chat([{"role": "wizard", "content": "hi"}], use_tqdm=False)
    with pytest.raises(ValueError, match="tokenize"):
        offline_llm.chat(MSG, chat_template_kwargs={"tokenize": True}, use_tqdm=False)
    out = offline_llm.chat(
        MSG, SamplingParams(max_tokens=2), use_tqdm=False, chat_template_kwargs={"chat_template": "{{ 'hi' }}"}
    )  # the caller's own: trusted
    assert len(out[0].prompt_token_ids) < 5
    offline_llm.check_integrity()


def test_media_must_match_the_part_type():
    from tests.api.test_api_media import mp4_bytes
    from vlserve.multimodal.media import load_image, load_video

    with pytest.raises(ValueError, match="text/plain"):
        load_image(data_url(png_bytes(0), "text/plain"))
    with pytest.raises(ValueError, match="still image"):
        load_video(data_url(png_bytes(0), "video/mp4"))
    with pytest.raises(ValueError, match="video"):
        load_video(data_url(mp4_bytes(), "image/png"))
    assert load_image(data_url(png_bytes(0), "application/octet-stream")).size == (56, 56)
    assert load_video(data_url(mp4_bytes(), "video/mp4")).frames.shape[0] == 4


# -- 4. error messages ----------------------------------------------------------------------------------------------
def test_lone_surrogate_is_named_not_leaked(server):
    body = b'{"model": "tiny-text", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    r = server.http.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert_error_shape(r, 400, "surrogate")
    assert "messages.0.content" in r.json()["error"]["message"] and "TextEncodeInput" not in r.text
    r = server.http.post(
        COMPL, content=b'{"model": "tiny-text", "prompt": "\\udfff"}', headers={"content-type": "application/json"}
    )
    assert_error_shape(r, 400, "surrogate")


def test_huge_values_are_not_echoed(server):
    huge = "m" * 1_000_000
    for body, status in (
        (chat(model=huge), 404),
        (chat(mm_processor_kwargs={huge: 1}), 400),
        (chat(messages=[{"role": huge, "content": "x"}]), 400),
        (chat(messages=[{"role": "user", "content": [{"type": huge}]}]), 400),
    ):
        r = server.http.post(CHAT, json=body)
        assert r.status_code == status, r.text[:300]
        assert len(r.json()["error"]["message"]) < 400


def test_file_urls_name_the_problem(tmp_path):
    from vlserve.api.errors import APIError
    from vlserve.api.media import MediaConfig, MediaFetcher

    (tmp_path / "sub").mkdir()
    os.mkfifo(tmp_path / "fifo")
    fetcher = MediaFetcher(MediaConfig(allowed_local_media_path=str(tmp_path)))
    for name, words in (
        ("sub", "directory"),
        ("fifo", "not a regular file"),
        ("missing.png", "not found"),
        ("a%00b.png", "NUL"),
    ):
        part = {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/{name}"}}
        with pytest.raises(APIError) as e:
            asyncio.run(fetcher.fetch("image_url", part))
        assert words in e.value.message and e.value.status == 400


def test_nothing_leaked_after_hostile_requests(server, trusting_server):
    for served in (server, trusting_server):
        served.wait_idle()
        served.engine.engine.check_integrity()
        assert served.http.get("/health").status_code == 200


def test_cli_flags_for_templates_and_body_cap():
    from vlserve.cli import build_parser, serve_config_from_args

    _, default = serve_config_from_args(build_parser().parse_args(["serve", "/m"]))
    assert not default.trust_request_chat_template and default.max_body_bytes == 64 << 20
    _, config = serve_config_from_args(
        build_parser().parse_args(["serve", "/m", "--trust-request-chat-template", "--max-request-body-bytes", "1000"])
    )
    assert config.trust_request_chat_template and config.max_body_bytes == 1000
