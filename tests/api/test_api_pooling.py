"""The pooling endpoints on a tiny Qwen2 text embedder: /v1/embeddings through the `openai` client (float and
base64) against `LLM.embed` and HF's last hidden state, /pooling against `LLM.encode`, /v1/score (cosine) against
`LLM.score`, /v1/models' tasks, every refusal as an OpenAI-style 400 with the server still serving and no KV block
left, and the pooling endpoints refused by a generation server (and the reverse)."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch

from tests.api.conftest import TEXT_ENGINE_KW, start_server

TEXTS = ["the quick brown fox", "hello there", "a somewhat longer sentence about pooled states"]
POOL_KW = dict(TEXT_ENGINE_KW, runner="pooling", convert="embed")


@pytest.fixture(scope="module")
def embed_server(text_ckpt):
    from vlserve.config import EngineArgs

    served = start_server(EngineArgs(model=text_ckpt, served_model_name="tiny-embed", **POOL_KW))
    yield served
    served.close()


@pytest.fixture(scope="module")
def offline_embedder(text_ckpt):
    from vlserve import LLM

    llm = LLM(text_ckpt, **POOL_KW)
    yield llm
    llm.shutdown()


def _error(response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_embeddings_match_llm_embed_and_hf(embed_server, offline_embedder, text_ckpt):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    client = embed_server.client
    as_float = client.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float")
    by_default = client.embeddings.create(model="tiny-embed", input=TEXTS)  # the client asks for base64
    ours = [o.outputs.embedding for o in offline_embedder.embed(TEXTS, use_tqdm=False)]
    assert [d.index for d in as_float.data] == [0, 1, 2] and as_float.model == "tiny-embed"
    # two requests need not agree to the last bit (a prefix-cache hit or another step composition changes the
    # summation order), but base64 carries float32: anything coarser (float16, wrong byte order) shows at 1e-6
    for a, b, ref in zip(as_float.data, by_default.data, ours):
        assert np.allclose(a.embedding, ref, atol=1e-6)
        assert np.allclose(np.asarray(b.embedding, dtype=np.float32), np.asarray(a.embedding), rtol=0, atol=1e-6)
    tok = AutoTokenizer.from_pretrained(text_ckpt)
    assert as_float.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in TEXTS) == as_float.usage.total_tokens
    model = AutoModelForCausalLM.from_pretrained(text_ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([tok(TEXTS[0])["input_ids"]]), output_hidden_states=True)
    ref = torch.nn.functional.normalize(hidden.hidden_states[-1][0, -1].float(), dim=-1)
    assert torch.nn.functional.cosine_similarity(torch.tensor(as_float.data[0].embedding), ref, dim=0) >= 0.9999
    raw = embed_server.http.post("/v1/embeddings", json={"input": TEXTS[1], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, ours[1], atol=1e-6) and raw["object"] == "list"
    assert raw["data"][0]["object"] == "embedding"
    embed_server.wait_idle()


def test_token_ids_and_truncation(embed_server, offline_embedder):
    ids = offline_embedder.tokenizer(TEXTS[2])["input_ids"]
    one = embed_server.client.embeddings.create(model="tiny-embed", input=ids, encoding_format="float")
    many = embed_server.client.embeddings.create(model="tiny-embed", input=[ids, ids[:3]], encoding_format="float")
    ref = offline_embedder.embed([{"prompt_token_ids": ids}, {"prompt_token_ids": ids[-3:]}], use_tqdm=False)
    assert np.allclose(one.data[0].embedding, ref[0].outputs.embedding, atol=1e-6)
    assert np.allclose(many.data[0].embedding, ref[0].outputs.embedding, atol=1e-6)
    cut = embed_server.http.post(
        "/v1/embeddings", json={"input": TEXTS[2], "truncate_prompt_tokens": 3, "encoding_format": "float"}
    ).json()
    assert np.allclose(cut["data"][0]["embedding"], ref[1].outputs.embedding, atol=1e-6)
    assert cut["usage"]["prompt_tokens"] == 3
    embed_server.wait_idle()


def test_messages_render_like_chat(embed_server, offline_embedder):
    messages = [{"role": "user", "content": "what is a fox?"}]
    body = {"messages": messages, "add_generation_prompt": True, "encoding_format": "float"}
    got = embed_server.http.post("/v1/embeddings", json=body).json()
    ref = offline_embedder.embed([messages], use_tqdm=False)[0]  # a conversation, with a generation prompt
    assert np.allclose(got["data"][0]["embedding"], ref.outputs.embedding, atol=1e-6)
    assert got["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    plain = embed_server.http.post("/v1/embeddings", json={"messages": messages}).json()
    assert plain["usage"]["prompt_tokens"] < len(ref.prompt_token_ids)  # vLLM's default: no generation prompt
    embed_server.wait_idle()


def test_pooling_and_score_match_llm(embed_server, offline_embedder):
    from vlserve.pooling_params import PoolingParams

    got = embed_server.http.post("/pooling", json={"input": TEXTS[:2]}).json()
    ref = offline_embedder.encode(TEXTS[:2], PoolingParams(task="encode"), use_tqdm=False)
    assert [d["object"] for d in got["data"]] == ["pooling", "pooling"]
    for d, r in zip(got["data"], ref):
        assert np.allclose(d["data"], r.outputs.data.numpy(), atol=1e-5)  # not normalized
    normalized = embed_server.http.post("/pooling", json={"input": TEXTS[0], "task": "embed"}).json()
    assert abs(np.linalg.norm(normalized["data"][0]["data"]) - 1) < 1e-5
    for body in ({"text_1": TEXTS[0], "text_2": TEXTS}, {"queries": TEXTS, "documents": TEXTS[::-1]}):
        first, second = list(body.values())
        scores = embed_server.http.post("/v1/score", json=body).json()
        ref_scores = [s.outputs.score for s in offline_embedder.score(first, second, use_tqdm=False)]
        assert [d["index"] for d in scores["data"]] == [0, 1, 2] and scores["object"] == "list"
        assert np.allclose([d["score"] for d in scores["data"]], ref_scores, atol=1e-5)
    assert abs(scores["data"][1]["score"] - 1.0) < 1e-5  # the same text on both sides
    embed_server.wait_idle()


def test_models_list_tasks(embed_server, server):
    assert embed_server.http.get("/v1/models").json()["data"][0]["tasks"] == ["embed", "encode"]
    assert server.http.get("/v1/models").json()["data"][0]["tasks"] == ["generate"]


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        ("/v1/embeddings", {"input": []}, "input", "empty"),
        ("/v1/embeddings", {"input": ""}, "input", "empty"),
        ("/v1/embeddings", {"input": [1, "a"]}, "input", ""),
        ("/v1/embeddings", {"input": "a", "dimensions": 8}, "dimensions", "Matryoshka"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format", ""),
        ("/v1/embeddings", {"input": "a", "temperature": 0.5}, "temperature", "Extra inputs"),
        ("/v1/embeddings", {"input": "a", "messages": [{"role": "user", "content": "b"}]}, None, "exactly one"),
        ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 99999}, "truncate_prompt_tokens", "max_model_len"),
        (
            "/v1/embeddings",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
            "messages",
            "image input is not supported",
        ),
        ("/v1/embeddings", {"input": [[10**9]]}, None, "prompt_token_ids"),
        ("/pooling", {"input": "a", "task": "classify"}, None, "not served"),
        ("/pooling", {"input": "a", "task": "embed", "use_activation": True}, "use_activation", "classify"),
        ("/v1/embeddings", {"input": [[1, 2]], "add_special_tokens": False}, "add_special_tokens", "token ids"),
        ("/v1/embeddings", {"input": "a", "add_generation_prompt": True}, None, "messages only"),
        ("/v1/score", '{"text_1": "\\ud800", "text_2": "b"}', "text_1", "surrogate"),  # raw JSON text
        ("/v1/score", {"text_1": "a"}, None, "text_2 is missing"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "1:N or N:N"),
        ("/v1/score", {"queries": "a", "documents": []}, "documents", "empty"),
        ("/v1/score", {"text_1": "a", "text_2": 5}, "text_2", "must be a string"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "use_activation": True}, "use_activation", "embeds"),
        (
            "/v1/score",
            {"text_1": "a", "text_2": {"content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}},
            "text_2",
            "image input is not supported",
        ),
        ("/v1/rerank", {"query": ["a"], "documents": ["b"]}, "query", "one string"),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n", ""),
    ],
)
def test_bad_requests_are_400s(embed_server, path, body, param, words):
    if isinstance(body, str):
        sent = embed_server.http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        sent = embed_server.http.post(path, json=body)
    err = _error(sent)
    assert (err["param"] or "").split(".")[0] == (param or "") and words in err["message"], err
    assert embed_server.http.post("/v1/embeddings", json={"input": "still serving"}).status_code == 200
    embed_server.wait_idle()


def test_generation_endpoints_refused_on_a_pooling_server(embed_server):
    with pytest.raises(openai.BadRequestError, match="pooling runner"):
        embed_server.client.chat.completions.create(model="tiny-embed", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="pooling runner"):
        embed_server.client.completions.create(model="tiny-embed", prompt="hi", max_tokens=2)
    err = _error(embed_server.http.post("/v1/responses", json={"model": "tiny-embed", "input": "hi"}))
    assert "pooling runner" in err["message"]
    embed_server.wait_idle()


def test_pooling_endpoints_refused_on_a_generation_server(server):
    with pytest.raises(openai.BadRequestError, match="generation runner"):
        server.client.embeddings.create(model="tiny-text", input="hi")
    for path, body in (
        ("/pooling", {"input": "hi"}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}),
        ("/rerank", {"query": "a", "documents": ["b"]}),
        ("/v2/rerank", {"query": "a", "documents": ["b"]}),
        ("/score", {"text_1": "a", "text_2": "b"}),
    ):
        assert "generation runner" in _error(server.http.post(path, json=body))["message"]
    assert server.client.completions.create(model="tiny-text", prompt="hi", max_tokens=2).choices
    server.wait_idle()


def test_matryoshka_dimensions(tmp_path, text_ckpt, offline_embedder):
    import json
    import shutil

    from vlserve.config import EngineArgs
    from vlserve.pooling_params import PoolingParams

    model_dir = str(tmp_path / "matryoshka")
    shutil.copytree(text_ckpt, model_dir)
    with open(f"{model_dir}/config.json") as f:
        config = json.load(f)
    config.update(is_matryoshka=True, matryoshka_dimensions=[16, 32])
    with open(f"{model_dir}/config.json", "w") as f:
        json.dump(config, f)
    served = start_server(EngineArgs(model=model_dir, **POOL_KW))
    try:
        got = served.client.embeddings.create(model=served.model, input=TEXTS[0], dimensions=16)
        raw = offline_embedder.encode(TEXTS[0], PoolingParams(task="encode"), use_tqdm=False)[0].outputs.data
        ref = torch.nn.functional.normalize(raw[:16], dim=-1).numpy()  # truncated, then normalized
        assert len(got.data[0].embedding) == 16 and np.allclose(got.data[0].embedding, ref, atol=1e-6)
        err = _error(served.http.post("/v1/embeddings", json={"input": "a", "dimensions": 20}))
        assert err["param"] == "dimensions" and "one of [16, 32]" in err["message"]
        served.wait_idle()
    finally:
        served.close()


@pytest.mark.slow
def test_vlserve_serve_runner_pooling(text_ckpt, repo_root):
    import httpx

    from tests.api.conftest import serve_subprocess

    args = [text_ckpt, "--runner", "pooling", "--convert", "embed", "--dtype", "float32", "--num-kv-blocks", "64"]
    with serve_subprocess(args, repo_root) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        got = client.embeddings.create(model=text_ckpt, input=TEXTS[:2])
        assert len(got.data) == 2 and abs(np.linalg.norm(got.data[0].embedding) - 1) < 1e-5
        score = httpx.post(f"{base}/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[:2]}, trust_env=False)
        assert abs(score.json()["data"][0]["score"] - 1) < 1e-5
        with pytest.raises(openai.BadRequestError, match="pooling runner"):
            client.chat.completions.create(model=text_ckpt, messages=[{"role": "user", "content": "hi"}])


def test_the_api_key_gate_comes_before_the_refusal(embed_server):
    import httpx

    from tests.api.conftest import ServerThread
    from vlserve.api.server import ServerConfig, build_app

    thread = ServerThread(build_app(embed_server.engine, ServerConfig(api_key="k", shutdown_engine=False))).start()
    try:
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(base_url=thread.base_url, trust_env=False) as http:
            assert http.post("/v1/chat/completions", json=chat).status_code == 401
            authed = http.post("/v1/chat/completions", json=chat, headers={"Authorization": "Bearer k"})
            assert authed.status_code == 400 and "pooling runner" in authed.json()["error"]["message"]
            assert http.post("/v1/embeddings", json={"input": "a"}).status_code == 401
    finally:
        thread.stop()
