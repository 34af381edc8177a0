"""Every bad input gets the right 4xx in OpenAI's error shape, and the server keeps serving afterwards."""

from __future__ import annotations

import openai
import pytest

MSG = [{"role": "user", "content": "hello"}]
CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"


def chat(**kw):
    return {"model": "tiny-text", "messages": MSG, "max_tokens": 2, **kw}


BAD_REQUESTS = [
    # (path, json body, expected status, words expected in the message)
    (CHAT, {"model": "tiny-text"}, 400, "messages"),
    (CHAT, chat(messages=[]), 400, "messages"),
    (CHAT, chat(messages="hi"), 400, "messages"),
    (CHAT, chat(messages=[{"content": "no role"}]), 400, "role"),
    (CHAT, chat(temperature=-1), 400, "temperature"),
    (CHAT, chat(top_p=1.5), 400, "top_p"),
    (CHAT, chat(top_k=-5), 400, "top_k"),
    (CHAT, chat(min_p=2), 400, "min_p"),
    (CHAT, chat(n=0), 400, "n must"),
    (CHAT, chat(max_tokens=0), 400, "max_tokens"),
    (CHAT, chat(max_tokens="many"), 400, "max_tokens"),
    (CHAT, chat(max_completion_tokens=-3), 400, "max_completion_tokens"),
    (CHAT, chat(presence_penalty=5), 400, "presence_penalty"),
    (CHAT, chat(frequency_penalty=-5), 400, "frequency_penalty"),
    (CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    (CHAT, chat(seed="x"), 400, "seed"),
    (CHAT, chat(seed=2**70), 400, "seed"),
    (CHAT, chat(n=2**40), 400, "n must"),
    (CHAT, chat(logit_bias={"5": 101}), 400, "logit_bias"),
    (CHAT, chat(stop=[""]), 400, "stop"),
    (CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    (CHAT, chat(top_logprobs=2), 400, "logprobs"),
    (CHAT, chat(stream_options={"include_usage": "maybe"}), 400, "include_usage"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "hologram"}]}]), 400, "hologram"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400, "text"),
    (CHAT, chat(messages=[{"role": "user", "content": ["bare string part"]}]), 400, "content"),
    (
        CHAT,
        chat(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
            ]
        ),
        400,
        "image",
    ),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image", "image": "/etc/passwd"}]}]), 400, "image"),
    (CHAT, chat(mm_processor_kwargs={"evil": 1}), 400, "mm_processor_kwargs"),
    (CHAT, chat(mm_processor_kwargs={"max_pixels": -1}), 400, "mm_processor_kwargs"),
    (CHAT, chat(messages=[{"role": "user", "content": "many words " * 700}]), 400, "max_model_len"),
    (CHAT, chat(model="gpt-4"), 404, "gpt-4"),
    (COMPL, {"model": "tiny-text", "prompt": []}, 400, "prompt"),
    (COMPL, {"model": "tiny-text", "prompt": [10, 99999999]}, 400, "prompt_token_ids"),
    (COMPL, {"model": "tiny-text", "prompt": [[]]}, 400, "empty"),
    (COMPL, {"model": "tiny-text", "prompt": ""}, 400, "empty"),
    (COMPL, {"model": "tiny-text", "prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    (COMPL, {"model": "tiny-text", "prompt": "x", "logprobs": 99}, 400, "logprobs"),
    (COMPL, {"model": "tiny-text", "prompt": {"a": 1}}, 400, "prompt"),
    (COMPL, {"model": "nope", "prompt": "x"}, 404, "nope"),
]


def assert_error_shape(resp, status: int, words: str = "") -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["type"], str) and err["message"]
    assert words.lower() in err["message"].lower(), err["message"]


@pytest.mark.parametrize(
    "path,body,status,words", BAD_REQUESTS, ids=[f"{i}-{b[2]}-{b[3]}" for i, b in enumerate(BAD_REQUESTS)]
)
def test_bad_request(server, path, body, status, words):
    assert_error_shape(server.http.post(path, json=body), status, words)


def test_bad_requests_streamed_get_status_not_stream(server):
    resp = server.http.post(CHAT, json=chat(temperature=-1, stream=True))
    assert_error_shape(resp, 400, "temperature")


def test_invalid_json_and_wrong_content(server):
    resp = server.http.post(
        CHAT, content=b'{"model": "tiny-text", "messages": [', headers={"content-type": "application/json"}
    )
    assert_error_shape(resp, 400, "json")
    for number in (b"NaN", b"Infinity", b"-Infinity"):
        body = b'{"model": "tiny-text", "messages": [{"role": "user", "content": "x"}], "temperature": ' + number + b"}"
        assert_error_shape(
            server.http.post(CHAT, content=body, headers={"content-type": "application/json"}), 400, "temperature"
        )
    assert_error_shape(server.http.post(CHAT, content=b"\xff\xfe", headers={"content-type": "application/json"}), 400)
    assert_error_shape(server.http.post(CHAT, content=b"[1, 2]", headers={"content-type": "application/json"}), 400)
    assert_error_shape(server.http.post(COMPL, content=b"hello", headers={"content-type": "text/plain"}), 400)


def test_unknown_route_and_method(server):
    assert_error_shape(server.http.get("/v1/nothing"), 404)
    assert_error_shape(server.http.get(CHAT), 405)


def test_openai_client_exceptions(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model="tiny-text", messages=MSG, temperature=-2)
    assert e.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        server.client.chat.completions.create(model="other", messages=MSG)
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model="tiny-text", prompt="x", n=-1)


def test_server_keeps_serving_after_errors(server):
    for path, body, *_ in BAD_REQUESTS[:10]:
        server.http.post(path, json=body)
    assert server.http.get("/health").status_code == 200
    r = server.client.chat.completions.create(model="tiny-text", messages=MSG, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")
    server.wait_idle()
    server.engine.engine.check_integrity()
