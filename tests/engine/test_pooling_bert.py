"""BERT encoders through the pooling engine: which runner and pooler a BERT checkpoint gets (`resolve_pooler_spec`
with sentence-transformers' files, old and new layouts), and `LLM(dir, runner="pooling")` / runner auto `.embed`,
`.score` and `.classify` against sentence-transformers' SentenceTransformer and CrossEncoder on tiny random
checkpoints (tests/support/bert_checkpoints.py). The engine calls go through the runner's KV-free seam: the model's
`pool_prompts(token_ids, spec)` on whole prompts."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from tests.support.bert_checkpoints import PAIRS, TEXTS, TINY_BERT, build_bert_cross_encoder, build_bert_embedder
from vlserve.config import EngineArgs
from vlserve.engine.pooling import (
    resolve_pooler_spec,
    sentence_transformers_max_seq_length,
    sentence_transformers_pooling,
)
from vlserve.pooling_params import PoolingParams

pytestmark = pytest.mark.hf_parity


@pytest.fixture(scope="module")
def mean_embedder(tmp_path_factory):
    return build_bert_embedder(str(tmp_path_factory.mktemp("bert_mean")), pooling_mode="mean", normalize=True)


@pytest.fixture(scope="module")
def cls_embedder(tmp_path_factory):
    return build_bert_embedder(str(tmp_path_factory.mktemp("bert_cls")), pooling_mode="cls", normalize=False)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    return build_bert_cross_encoder(str(tmp_path_factory.mktemp("bert_ce")))


def _spec(path: str, **kw):
    args = EngineArgs(model=path, **kw)
    return resolve_pooler_spec(args, AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path), path)


def _st_embeddings(path: str, texts) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return torch.from_numpy(SentenceTransformer(path, device="cpu").encode(list(texts), batch_size=len(texts)))


def _cross_encoder_scores(path: str, pairs) -> torch.Tensor:
    from sentence_transformers import CrossEncoder

    return torch.from_numpy(CrossEncoder(path, device="cpu").predict(list(pairs), batch_size=len(pairs))).float()


def test_runner_auto_pools_bert_checkpoints(mean_embedder, cls_embedder, cross_encoder):
    spec = _spec(mean_embedder)  # runner auto: an encoder-only model pools
    assert (spec.task, spec.pooling_type, spec.normalize) == ("embed", "MEAN", True)  # 1_Pooling + 2_Normalize
    spec = _spec(cls_embedder)
    assert (spec.task, spec.pooling_type, spec.normalize) == ("embed", "CLS", False)  # no Normalize module
    spec = _spec(cross_encoder)
    assert (spec.task, spec.pooling_type, spec.normalize) == ("classify", "CLS", False)  # BERT's [CLS] pooler
    assert spec.supported_tasks == {"classify", "score", "encode"}
    assert _spec(mean_embedder, pooler_config={"pooling_type": "LAST"}).pooling_type == "LAST"  # the user's wins
    assert _spec(mean_embedder, runner="generate") is None


def test_bert_model_without_sentence_transformers_files_pools_cls(tmp_path, mean_embedder):
    import shutil

    bare = str(tmp_path / "bare")
    shutil.copytree(mean_embedder, bare, ignore=shutil.ignore_patterns("modules.json", "1_Pooling", "2_Normalize"))
    assert sentence_transformers_pooling(bare) == (None, None)
    spec = _spec(bare)
    assert (spec.task, spec.pooling_type, spec.normalize) == ("embed", "CLS", True)


def test_both_sentence_transformers_layouts_are_read(tmp_path, mean_embedder):
    """sentence-transformers 6 writes `...modules.pooling.Pooling` and `"pooling_mode": "mean"`; earlier versions
    (most hub checkpoints) `sentence_transformers.models.Pooling` and `"pooling_mode_mean_tokens": true`."""
    import shutil

    with open(os.path.join(mean_embedder, "1_Pooling", "config.json")) as f:
        assert json.load(f).get("pooling_mode") == "mean"  # this version's layout
    old = str(tmp_path / "old")
    shutil.copytree(mean_embedder, old)
    with open(os.path.join(old, "modules.json"), "w") as f:
        json.dump(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            ],
            f,
        )
    with open(os.path.join(old, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 32, "pooling_mode_cls_token": True}, f)
    assert sentence_transformers_pooling(old) == ("CLS", True)
    with open(os.path.join(old, "1_Pooling", "config.json"), "w") as f:
        json.dump({"embedding_dimension": 32, "pooling_mode": "max"}, f)
    with pytest.raises(ValueError, match="pooling_mode must be one of"):
        sentence_transformers_pooling(old)


def _llm(path: str, **kw):
    from vlserve import LLM

    return LLM(path, dtype="float32", **kw)


@pytest.mark.parametrize("runner", ["pooling", "auto"])
def test_embed_matches_sentence_transformers(mean_embedder, cls_embedder, runner):
    for path in (mean_embedder, cls_embedder):
        ref = _st_embeddings(path, TEXTS)
        llm = _llm(path, runner=runner)
        try:
            assert llm.engine.runner_type == "pooling"
            outs = llm.embed(TEXTS, use_tqdm=False)
            ours = torch.tensor([o.outputs.embedding for o in outs])  # [N, E]
            cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
            assert cos.min().item() >= 0.9999 and (ours - ref).abs().max().item() <= 1e-4
            tokenizer = AutoTokenizer.from_pretrained(path)
            assert [o.prompt_token_ids for o in outs] == [tokenizer(t)["input_ids"] for t in TEXTS]
            scores = llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)  # an embedder scores by cosine
            ref_cos = torch.nn.functional.cosine_similarity(ref[:1], ref[1:], dim=-1)
            assert torch.allclose(torch.tensor([s.outputs.score for s in scores]), ref_cos, atol=1e-4)
            llm.check_integrity()
        finally:
            llm.shutdown()


def test_sentence_transformers_max_seq_length_bounds_the_engine(tmp_path, mean_embedder):
    """sentence-transformers truncates inputs at its max_seq_length: the engine takes it as max_model_len, from the
    tokenizer's model_max_length (where sentence-transformers 6 keeps it) or sentence_bert_config.json (2-5)."""
    import shutil

    tokenizer = AutoTokenizer.from_pretrained(mean_embedder)
    assert tokenizer.model_max_length == TINY_BERT["max_position_embeddings"]  # as the builder saved it
    assert sentence_transformers_max_seq_length(mean_embedder, tokenizer) == TINY_BERT["max_position_embeddings"]
    old = str(tmp_path / "old")
    shutil.copytree(mean_embedder, old)
    with open(os.path.join(old, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 12, "do_lower_case": False}, f)
    assert sentence_transformers_max_seq_length(old, tokenizer) == 12
    assert sentence_transformers_max_seq_length(os.path.join(old, "1_Pooling"), tokenizer) is None  # no modules.json
    llm = _llm(old)
    try:
        assert llm.engine.max_model_len == 12
        long_text = TEXTS[2]
        assert len(tokenizer(long_text)["input_ids"]) > 12
        with pytest.raises(ValueError, match="12"):
            llm.embed([long_text], use_tqdm=False)
        assert len(llm.embed([TEXTS[1]], use_tqdm=False)) == 1  # the engine carries on
        llm.check_integrity()
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="sentence-transformers max_seq_length=12"):
        _llm(old, max_model_len=32)


def test_score_matches_cross_encoder(cross_encoder):
    ref = _cross_encoder_scores(cross_encoder, PAIRS)
    tokenizer = AutoTokenizer.from_pretrained(cross_encoder)
    llm = _llm(cross_encoder)  # runner auto: a *ForSequenceClassification checkpoint pools
    try:
        assert llm.engine.runner_type == "pooling"
        query = PAIRS[0][0]
        docs = [d for q, d in PAIRS if q == query]
        one_query = llm.score(query, docs, use_tqdm=False)
        pairwise = llm.score([q for q, _ in PAIRS], [d for _, d in PAIRS], use_tqdm=False)
        ours = torch.tensor([s.outputs.score for s in pairwise])
        assert (ours - ref).abs().max().item() <= 1e-4  # sigmoid of the one logit, as CrossEncoder.predict
        assert torch.allclose(torch.tensor([s.outputs.score for s in one_query]), ref[: len(docs)], atol=1e-4)
        for out, (q, d) in zip(pairwise, PAIRS):
            ids = tokenizer(q, d)["input_ids"]  # [CLS] q [SEP] d [SEP]
            assert out.prompt_token_ids == ids
            assert ids[0] == tokenizer.cls_token_id and ids.count(tokenizer.sep_token_id) == 2
            assert ids[-1] == tokenizer.sep_token_id
        probs = llm.classify(TEXTS, use_tqdm=False)
        raw = llm.classify(TEXTS, PoolingParams(activation=False), use_tqdm=False)
        for p, r in zip(probs, raw):
            assert len(p.outputs.probs) == 1
            assert p.outputs.probs[0] == pytest.approx(torch.sigmoid(torch.tensor(r.outputs.probs[0])).item(), abs=1e-6)
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_bf16_engine_stays_close(mean_embedder, cross_encoder):
    from vlserve import LLM

    ref = _st_embeddings(mean_embedder, TEXTS)
    llm = LLM(mean_embedder, dtype="bfloat16")
    try:
        ours = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
        assert torch.nn.functional.cosine_similarity(ours, ref, dim=-1).min().item() >= 0.999
    finally:
        llm.shutdown()
    ref = _cross_encoder_scores(cross_encoder, PAIRS)
    llm = LLM(cross_encoder, dtype="bfloat16")
    try:
        scores = llm.score([q for q, _ in PAIRS], [d for _, d in PAIRS], use_tqdm=False)
        assert (torch.tensor([s.outputs.score for s in scores]) - ref).abs().max().item() <= 1e-2
    finally:
        llm.shutdown()
