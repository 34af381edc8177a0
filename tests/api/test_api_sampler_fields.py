"""logit_bias, allowed_token_ids, bad_words and prompt_logprobs over HTTP with the `openai` client (vLLM's fields
through extra_body): the offline LLM's tokens, HF's prompt log-softmax, 400s for bad values, and the server still
serving afterwards."""

from __future__ import annotations

import openai
import pytest
import torch

from vlserve import SamplingParams

PROMPT_IDS = [23, 285, 76, 639, 44, 17, 302, 415, 90, 512, 33, 8, 77, 640, 120, 5, 9, 200, 301, 444]
MESSAGES = [{"role": "user", "content": "Name a shape."}]


@pytest.fixture(scope="module")
def hf_logprobs(text_ckpt):
    """HF's log-softmax over PROMPT_IDS: row i is the distribution of token i + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(text_ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([PROMPT_IDS])).logits[0].float(), dim=-1)


def offline(llm, **fields):
    """The offline engine's greedy CompletionOutput of PROMPT_IDS with `fields`."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, **fields)
    return llm.generate([{"prompt_token_ids": PROMPT_IDS}], params, use_tqdm=False)[0].outputs[0]


def bad_words_from(tok, tokens: list[int]) -> list[str]:
    """A one-token and a two-token word of `tokens` that tokenize back to those very tokens."""

    def word(ids):
        text = tok.decode(ids)
        ok = "\ufffd" not in text and tok.encode(text.lstrip(), add_special_tokens=False) == ids
        return text if ok else None

    single = next(w for t in tokens if (w := word([t])))
    pair = next(w for i in range(len(tokens) - 1) if (w := word(tokens[i : i + 2])))
    return [single, pair]


def completion_text(server, **extra) -> str:
    r = server.client.completions.create(
        model=server.model,
        prompt=PROMPT_IDS,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, **extra},
    )
    return r.choices[0].text


def test_logit_bias_allowed_ids_and_bad_words_equal_offline(server, offline_llm):
    tok = offline_llm.get_tokenizer()
    plain = offline(offline_llm).token_ids
    cases = [
        {"logit_bias": {str(plain[0]): -100, "42": 2.5}},
        {"allowed_token_ids": [5, 77, 300, 512, plain[2]]},
        {"bad_words": bad_words_from(tok, plain)},
    ]
    for fields in cases:
        want = offline(offline_llm, **fields)
        assert want.token_ids != plain, fields  # the field changes this output
        assert completion_text(server, **fields) == want.text, fields
    # OpenAI's logit_bias is a declared parameter of the client: +100 forces the token
    r = server.client.completions.create(
        model=server.model, prompt=PROMPT_IDS, max_tokens=4, temperature=0.7, seed=2, logit_bias={"42": 100}
    )
    assert r.choices[0].text == tok.decode([42] * 4)
    chat = server.client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=4, logit_bias={"42": 100}, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].message.content == tok.decode([42] * 4)


def check_entries(entries, ref: torch.Tensor, k: int) -> None:
    assert len(entries) == len(PROMPT_IDS) and entries[0] is None
    for i in range(1, len(PROMPT_IDS)):
        entry, row, tok = entries[i], ref[i - 1], PROMPT_IDS[i]
        assert abs(entry[str(tok)]["logprob"] - float(row[tok])) < 1e-4
        assert entry[str(tok)]["rank"] == int((row > row[tok]).sum()) + 1
        assert isinstance(entry[str(tok)]["decoded_token"], str)
        top = row.topk(k).indices.tolist()
        assert all(str(t) in entry for t in top)


def test_prompt_logprobs_in_completions_match_hf(server, hf_logprobs):
    r = server.client.completions.create(
        model=server.model, prompt=PROMPT_IDS, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    check_entries(r.choices[0].model_dump()["prompt_logprobs"], hf_logprobs, 2)
    plain = server.http.post("/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 1})
    assert "prompt_logprobs" not in plain.json()["choices"][0]


def test_prompt_logprobs_in_chat_response(server):
    r = server.client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    entries = r.model_dump()["prompt_logprobs"]
    assert entries[0] is None and len(entries) == r.usage.prompt_tokens
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in entries[1:])


@pytest.mark.parametrize(
    "endpoint,extra,words",
    [
        ("completions", {"logit_bias": {"100000": 1}}, "outside the vocabulary"),
        ("completions", {"logit_bias": {"5": 150}}, "logit_bias"),
        ("chat", {"logit_bias": {"five": 1}}, "logit_bias"),
        ("chat", {"logit_bias": {"5": "x"}}, "logit_bias"),
        ("chat", {"allowed_token_ids": []}, "allowed_token_ids"),
        ("completions", {"allowed_token_ids": [3, 100000]}, "outside the vocabulary"),
        ("chat", {"bad_words": [""]}, "bad_words"),
        ("completions", {"bad_words": "word"}, "bad_words"),
        ("completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("chat", {"prompt_logprobs": 1, "stream": True}, "stream"),
        ("completions", {"prompt_logprobs": 1, "stream": True}, "stream"),
        ("chat", {"use_beam_search": True, "bad_words": ["x"]}, "bad_words"),
    ],
)
def test_bad_values_are_400s(server, endpoint, extra, words):
    body = {"model": server.model, "max_tokens": 2, **extra}
    body.update({"messages": MESSAGES} if endpoint == "chat" else {"prompt": "hi"})
    r = server.http.post(f"/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}", json=body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_server_alive_after_bad_values(server):
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=server.model, prompt="hi", max_tokens=2, logit_bias={"100000": 1})
    r = server.client.completions.create(model=server.model, prompt="hi", max_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop")
    server.wait_idle()
