"""The pooling endpoints on a tiny CLIP checkpoint served with no runner flag (a dual tower pools on its own):
/v1/embeddings of a text (`input`) and of an image (`messages`, one image_url part) equal `LLM.embed`'s, /v1/score of
a text against an image equals `LLM.score`'s, and the same image sent twice runs the tower once."""

from __future__ import annotations

import numpy as np
import pytest

from tests.api.conftest import start_server
from tests.api.test_api_media import data_url, png_bytes
from tests.support.dual_tower_checkpoints import build_checkpoint

IMAGE_PART = {"type": "image_url", "image_url": {"url": data_url(png_bytes(3, (40, 48)))}}


@pytest.fixture(scope="module")
def clip_pair(tmp_path_factory):
    """(server, offline LLM) on the same CLIP checkpoint."""
    from vlserve import LLM
    from vlserve.config import EngineArgs

    path = str(tmp_path_factory.mktemp("clip_api"))
    build_checkpoint("clip", path)
    served = start_server(EngineArgs(model=path, served_model_name="clip", dtype="float32"))
    llm = LLM(path, dtype="float32")
    yield served, llm
    served.close()
    llm.shutdown()


def test_text_and_image_embeddings_equal_llm_embed(clip_pair):
    served, llm = clip_pair
    assert served.engine.model_capabilities.dual_tower
    text = served.client.embeddings.create(model="clip", input="a cat")
    assert np.allclose(text.data[0].embedding, llm.embed("a cat", use_tqdm=False)[0].outputs.embedding, atol=1e-5)
    messages = [{"role": "user", "content": [IMAGE_PART]}]
    runs = served.engine.get_metrics()["vlserve:encoder_runs_total"]
    for _ in range(2):  # the second time from the encoder cache
        image = served.client.embeddings.create(model="clip", input=None, extra_body={"messages": messages})
        ref = llm.embed([messages], use_tqdm=False)[0]
        assert np.allclose(image.data[0].embedding, ref.outputs.embedding, atol=1e-5)
    served.wait_idle()
    assert served.engine.get_metrics()["vlserve:encoder_runs_total"] == runs + 1


def test_text_against_image_score_equals_llm_score(clip_pair):
    served, llm = clip_pair
    documents = ["a dog", {"content": [IMAGE_PART]}]
    got = served.http.post("/v1/score", json={"queries": "a cat", "documents": documents}).json()
    ref = llm.score("a cat", documents, use_tqdm=False)
    assert np.allclose([d["score"] for d in got["data"]], [r.outputs.score for r in ref], atol=1e-5)
    both = [{"role": "user", "content": [IMAGE_PART, {"type": "text", "text": "a cat"}]}]
    r = served.http.post("/v1/embeddings", json={"messages": both})
    assert r.status_code == 400 and "one text or one image" in r.json()["error"]["message"]
    r = served.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    served.wait_idle()
    llm.check_integrity()
