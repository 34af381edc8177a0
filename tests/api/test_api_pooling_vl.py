"""The pooling endpoints on a tiny Qwen2-VL: image embeddings through `messages` (the chat endpoint's media path)
against `LLM.embed`, cosine scores of text against an image, and a yes/no reranker (`convert="classify"`) whose
/v1/score and /v1/rerank scores and order equal `LLM.score`'s, image documents included."""

from __future__ import annotations

import numpy as np
import pytest

from tests.api.conftest import start_server
from tests.api.test_api_media import data_url, png_bytes

VL_KW = dict(dtype="float32", max_model_len=1024, num_kv_blocks=128, block_size=16, runner="pooling")
IMAGE = data_url(png_bytes(3, (56, 84)))
IMAGE_PART = {"type": "image_url", "image_url": {"url": IMAGE}}


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    return build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("qwen2_vl_api_pool")), variant="qwen2_vl")


@pytest.fixture(scope="module")
def reranker_kw(qwen2_vl_dir):
    from transformers import AutoTokenizer

    no_token, yes_token = AutoTokenizer.from_pretrained(qwen2_vl_dir).convert_ids_to_tokens([101, 202])
    return dict(VL_KW, convert="classify", pooler_config={"classifier_from_token": [no_token, yes_token]})


@pytest.fixture(scope="module")
def embed_pair(qwen2_vl_dir):
    """(server, offline LLM) embedding with the same checkpoint."""
    from vlserve import LLM
    from vlserve.config import EngineArgs

    served = start_server(EngineArgs(model=qwen2_vl_dir, served_model_name="vl-embed", convert="embed", **VL_KW))
    llm = LLM(qwen2_vl_dir, convert="embed", **VL_KW)
    yield served, llm
    served.close()
    llm.shutdown()


@pytest.fixture(scope="module")
def rerank_pair(qwen2_vl_dir, reranker_kw):
    from vlserve import LLM
    from vlserve.config import EngineArgs

    served = start_server(EngineArgs(model=qwen2_vl_dir, served_model_name="vl-rerank", **reranker_kw))
    llm = LLM(qwen2_vl_dir, **reranker_kw)
    yield served, llm
    served.close()
    llm.shutdown()


def test_image_message_embedding_equals_llm_embed(embed_pair):
    served, llm = embed_pair
    messages = [{"role": "user", "content": [IMAGE_PART, {"type": "text", "text": "what is shown?"}]}]
    body = {"messages": messages, "add_generation_prompt": True}
    got = served.client.embeddings.create(model="vl-embed", extra_body=body, input=None)
    ref = llm.embed([messages], use_tqdm=False)[0]
    assert np.allclose(got.data[0].embedding, ref.outputs.embedding, atol=1e-5)
    assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
    llm.check_integrity()
    served.wait_idle()


def test_text_against_image_cosine_equals_llm_score(embed_pair):
    served, llm = embed_pair
    documents = ["a red square", {"content": [IMAGE_PART]}]
    got = served.http.post("/v1/score", json={"queries": "a picture", "documents": documents}).json()
    ref = llm.score("a picture", documents, use_tqdm=False)
    assert np.allclose([d["score"] for d in got["data"]], [r.outputs.score for r in ref], atol=1e-5)
    served.wait_idle()


def test_reranker_score_and_rerank_equal_llm_score(rerank_pair):
    served, llm = rerank_pair
    query = "where is the cat?"
    documents = ["a cat sat", "stock prices fell sharply today", {"content": [IMAGE_PART]}, "cats and mats"]
    ref = [r.outputs.score for r in llm.score(query, documents, use_tqdm=False)]
    got = served.http.post("/v1/score", json={"text_1": query, "text_2": documents}).json()
    assert np.allclose([d["score"] for d in got["data"]], ref, atol=1e-5)
    text_pair = llm.tokenizer(query, documents[0])["input_ids"]
    cross = served.http.post("/v1/score", json={"text_1": query, "text_2": documents[0]}).json()
    assert cross["usage"]["prompt_tokens"] == len(text_pair)  # two strings: the tokenizer's text pair
    ranked = served.http.post("/v1/rerank", json={"query": query, "documents": documents}).json()
    order = sorted(range(len(ref)), key=lambda i: -ref[i])
    assert [r["index"] for r in ranked["results"]] == order
    assert np.allclose([r["relevance_score"] for r in ranked["results"]], [ref[i] for i in order], atol=1e-5)
    by_index = {r["index"]: r["document"] for r in ranked["results"]}
    assert by_index[0] == {"text": "a cat sat"} and by_index[2] == {"multi_modal": [IMAGE_PART]}
    top = served.http.post(
        "/v2/rerank", json={"query": query, "documents": documents, "top_n": 2, "return_documents": False}
    ).json()
    assert [r["index"] for r in top["results"]] == order[:2] and "document" not in top["results"][0]
    assert top["usage"]["total_tokens"] == ranked["usage"]["total_tokens"] > 0
    image_query = {"content": [IMAGE_PART, {"type": "text", "text": "this picture"}]}  # one input, two parts
    by_image = served.http.post("/rerank", json={"query": image_query, "documents": documents[:2]}).json()
    ref = [r.outputs.score for r in llm.score([image_query], documents[:2], use_tqdm=False)]
    assert np.allclose(sorted(r["relevance_score"] for r in by_image["results"]), sorted(ref), atol=1e-5)
    llm.check_integrity()
    served.wait_idle()


def test_reranker_refuses_embeddings(rerank_pair):
    served, _ = rerank_pair
    r = served.http.post("/v1/embeddings", json={"input": "a"})
    assert r.status_code == 400 and "not served" in r.json()["error"]["message"]
    assert served.http.get("/v1/models").json()["data"][0]["tasks"] == ["classify", "encode", "score"]
    served.wait_idle()


def test_dual_tower_prompt():
    from vlserve.engine.scoring import dual_tower_prompt

    def source(ptype, part):
        return ("loaded", part[ptype]["url"])

    assert dual_tower_prompt([{"type": "text", "text": "a cat"}], source) == {"prompt": "a cat"}
    image = dual_tower_prompt([IMAGE_PART], source)
    assert image == {"prompt": "", "multi_modal_data": {"image": ("loaded", IMAGE)}}
    for bad in ([], [IMAGE_PART, IMAGE_PART], [{"type": "video_url", "video_url": {"url": "x"}}]):
        with pytest.raises(ValueError, match="dual-tower"):
            dual_tower_prompt(bad, source)
