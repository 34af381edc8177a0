"""POST /tokenize and /detokenize against real servers: a tiny text model and a tiny Qwen2-VL (image placeholders
counted as a chat request counts them), round trips, and bad input as OpenAI-style 400s with the server alive."""

from __future__ import annotations

import pytest

from tests.api.test_api_media import VL_ENGINE_KW, data_url, image_msg, png_bytes

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Count the tokens of this chat, please."},
]


@pytest.fixture(scope="module")
def hf_tokenizer(text_ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(text_ckpt)


def tokenize(served, **body) -> dict:
    r = served.http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def error_of(served, path: str, body) -> tuple[int, dict]:
    r = served.http.post(path, json=body) if not isinstance(body, bytes) else served.http.post(path, content=body)
    return r.status_code, r.json().get("error") or {}


def test_tokenize_prompt_matches_the_tokenizer(server, hf_tokenizer):
    prompt = "The quick brown fox jumps over the lazy dog. 123 ünïcödé"
    out = tokenize(server, model="tiny-text", prompt=prompt)
    expected = hf_tokenizer(prompt, add_special_tokens=True)["input_ids"]
    assert out["tokens"] == expected and out["count"] == len(expected)
    assert out["max_model_len"] == 1024 and out["token_strs"] is None
    with_strs = tokenize(server, prompt=prompt, add_special_tokens=False, return_token_strs=True)
    assert with_strs["tokens"] == hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert with_strs["token_strs"] == hf_tokenizer.convert_ids_to_tokens(with_strs["tokens"])
    assert tokenize(server, prompt="")["count"] == 0


def test_tokenize_messages_counts_what_a_chat_request_counts(server, hf_tokenizer):
    out = tokenize(server, model="alias", messages=MESSAGES)
    chat = server.client.chat.completions.create(model="tiny-text", messages=MESSAGES, max_tokens=1)
    assert out["count"] == chat.usage.prompt_tokens == len(out["tokens"])
    rendered = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert out["tokens"] == hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]

    no_header = tokenize(server, messages=MESSAGES, add_generation_prompt=False)
    rendered_no_header = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert rendered_no_header != rendered
    assert no_header["tokens"] == hf_tokenizer(rendered_no_header, add_special_tokens=False)["input_ids"]


def test_tokenize_detokenize_round_trip(server, hf_tokenizer):
    prompt = "Round trip: <tags>, emoji 🦊, newlines\n\tand tabs."
    tokens = tokenize(server, prompt=prompt)["tokens"]
    r = server.http.post("/detokenize", json={"model": "tiny-text", "tokens": tokens})
    assert r.status_code == 200 and r.json() == {"prompt": prompt}

    chat_tokens = tokenize(server, messages=MESSAGES)["tokens"]
    decoded = server.http.post("/detokenize", json={"tokens": chat_tokens}).json()["prompt"]
    assert decoded == hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert server.http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    "path,body,param,words",
    [
        ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, "messages", "not both"),
        ("/tokenize", {}, "prompt", "Field required"),
        ("/tokenize", {"prompt": "hi", "temperature": 0.5}, "temperature", "Extra inputs"),
        ("/tokenize", {"prompt": 7}, "prompt", "string"),
        ("/tokenize", {"messages": []}, "messages", "at least 1"),
        (
            "/tokenize",
            {"messages": MESSAGES, "continue_final_message": True},
            "continue_final_message",
            "not supported",
        ),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "role"),
        ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, None, "chat_template_kwargs"),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 1 }}"}, None, "trust-request-chat-template"),
        ("/tokenize", {"messages": MESSAGES, "tools": "a tool"}, None, "tools"),
        ("/tokenize", {"messages": image_msg(data_url(png_bytes(0)))}, "messages", "not supported by this model"),
        ("/tokenize", [1, 2], None, "JSON object"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens", "out of vocabulary"),
        ("/detokenize", {"tokens": [-1]}, "tokens", "out of vocabulary"),
        ("/detokenize", {"tokens": ["a"]}, "tokens.0", "integer"),
        ("/detokenize", {"prompt": "x"}, "tokens", "Field required"),
    ],
)
def test_bad_input_is_a_400_and_the_server_lives(server, path, body, param, words):
    status, err = error_of(server, path, body)
    assert status == 400, err
    assert words in err["message"], err
    assert err["type"] == "BadRequestError"
    if param is not None:
        assert err["param"] == param, err
    assert server.http.get("/health").status_code == 200
    assert tokenize(server, prompt="still here")["count"] > 0


def test_bad_json_and_unknown_model(server):
    status, err = error_of(server, "/tokenize", b"{not json")
    assert status == 400 and "invalid JSON" in err["message"]
    status, err = error_of(server, "/detokenize", {"model": "nope", "tokens": [1]})
    assert status == 404 and err["param"] == "model"
    status, err = error_of(server, "/tokenize", {"model": "nope", "prompt": "x"})
    assert status == 404


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    from tests.api.conftest import start_server
    from vlserve.config import EngineArgs
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    path = build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("tokenize_vl")))
    served = start_server(EngineArgs(model=path, served_model_name="tiny-vl", **VL_ENGINE_KW))
    yield served
    served.close()


@pytest.mark.slow
def test_image_placeholders_counted_as_a_chat_request_counts_them(vl_server):
    pad_id = vl_server.engine.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for size in ((56, 56), (112, 84)):
        messages = image_msg(data_url(png_bytes(1, size=size)), text="what is this?")
        out = tokenize(vl_server, messages=messages)
        chat = vl_server.client.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=1)
        assert out["count"] == chat.usage.prompt_tokens == len(out["tokens"])
        assert out["tokens"].count(pad_id) > 1  # the expanded run, not the template's single placeholder
    text_only = tokenize(vl_server, messages=[{"role": "user", "content": "what is this?"}])
    assert text_only["tokens"].count(pad_id) == 0 and text_only["count"] < out["count"]

    small = tokenize(vl_server, messages=messages, mm_processor_kwargs={"max_pixels": 56 * 56})
    assert small["tokens"].count(pad_id) < out["tokens"].count(pad_id)

    decoded = vl_server.http.post("/detokenize", json={"tokens": out["tokens"]}).json()["prompt"]
    assert decoded.count("<|image_pad|>") == out["tokens"].count(pad_id)


@pytest.mark.slow
def test_bad_image_is_a_400_and_the_vl_server_lives(vl_server):
    for url in ("data:image/png;base64,!!!notbase64", data_url(b"garbage bytes"), data_url(png_bytes(2)[:60])):
        status, err = error_of(vl_server, "/tokenize", {"messages": image_msg(url)})
        assert status == 400 and err["message"], (url[:40], err)
    status, err = error_of(vl_server, "/tokenize", {"messages": image_msg(*[data_url(png_bytes(3))] * 3)})
    assert status == 400 and "limit" in err["message"]
    assert vl_server.http.get("/health").status_code == 200
    assert tokenize(vl_server, messages=image_msg(data_url(png_bytes(4))))["count"] > 0
