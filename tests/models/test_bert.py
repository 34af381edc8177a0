"""BERT encoders (vlserve.models.bert) against HF's BertModel / BertForSequenceClassification and against
sentence-transformers' SentenceTransformer / CrossEncoder, on tiny random checkpoints with a real WordPiece
tokenizer (tests/support/bert_checkpoints.py), loaded through vlserve's load_model: float32 and bf16, padded
batches on the reference side, text pairs, CPU-packed linears, and the checks on bad input."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from tests.support.bert_checkpoints import PAIRS, TEXTS, build_bert_cross_encoder, build_bert_embedder
from vlserve.engine.pooling import sentence_transformers_pooling
from vlserve.kernels.packed_linear import pack_linears_for_cpu
from vlserve.models import load_model
from vlserve.models.bert import BertEmbeddingModel, BertForSequenceClassification, Segments, sep_token_id_of
from vlserve.models.capabilities import model_capabilities
from vlserve.models.registry import get_model_class
from vlserve.pooling_params import PoolerSpec

pytestmark = pytest.mark.hf_parity

CLASSIFY = PoolerSpec("CLS", False, "classify")  # what the engine resolves for a BERT cross-encoder


@pytest.fixture(scope="module", params=["mean", "cls"])
def embedder(request, tmp_path_factory):
    """(path, pooling mode) of a sentence-transformers embedder: MEAN with Normalize, CLS without."""
    mode = request.param
    path = str(tmp_path_factory.mktemp(f"bert_st_{mode}"))
    return build_bert_embedder(path, pooling_mode=mode, normalize=mode == "mean"), mode


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    return build_bert_cross_encoder(str(tmp_path_factory.mktemp("bert_ce")))


def _load(path: str, dtype: str = "float32"):
    return load_model(path, AutoConfig.from_pretrained(path), dtype, "cpu")


def _ids(tokenizer, texts) -> list[torch.Tensor]:
    return [torch.tensor(tokenizer(t)["input_ids"]) for t in texts]


def _pair_ids(tokenizer, pairs) -> list[torch.Tensor]:
    return [torch.tensor(tokenizer(q, d)["input_ids"]) for q, d in pairs]


def assert_close_rows(ours: torch.Tensor, ref: torch.Tensor, min_cos: float, max_abs: float) -> None:
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(ours, ref.float(), dim=-1)
    assert cos.min().item() >= min_cos, cos
    assert (ours - ref.float()).abs().max().item() <= max_abs


def hf_pooled(path: str, texts, mode: str) -> torch.Tensor:
    """HF BertModel's last hidden states over a right-padded batch, pooled by hand (masked mean, first, last)."""
    from transformers import BertModel

    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = BertModel.from_pretrained(path, dtype=torch.float32).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any()  # mixed lengths: some rows are padded
    with torch.no_grad():
        hidden = hf(**batch).last_hidden_state  # [B, T, E]
    mask = batch["attention_mask"].unsqueeze(-1).float()  # [B, T, 1]
    last = batch["attention_mask"].sum(dim=1) - 1  # [B]
    return {
        "MEAN": (hidden * mask).sum(dim=1) / mask.sum(dim=1),
        "CLS": hidden[:, 0],
        "LAST": hidden[torch.arange(len(texts)), last],
    }[mode]


def test_registry_routes_both_architectures(embedder, cross_encoder):
    for path, cls in ((embedder[0], BertEmbeddingModel), (cross_encoder, BertForSequenceClassification)):
        config = AutoConfig.from_pretrained(path)
        assert get_model_class(config) is cls
        caps = model_capabilities(cls, config)
        assert caps.pooling and caps.kv_free and not caps.dual_tower and not caps.multimodal


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS", "LAST"])
def test_embedder_matches_hf_bert_model(embedder, pooling_type):
    path, _ = embedder
    model = _load(path)
    ours = model.pool_prompts(_ids(AutoTokenizer.from_pretrained(path), TEXTS), PoolerSpec(pooling_type))
    assert_close_rows(ours, hf_pooled(path, TEXTS, pooling_type), 0.9999, 1e-4)


def test_embedder_matches_sentence_transformers(embedder):
    from sentence_transformers import SentenceTransformer

    path, mode = embedder
    pooling_type, normalize = sentence_transformers_pooling(path)  # what the engine reads
    assert (pooling_type, normalize) == ({"mean": "MEAN", "cls": "CLS"}[mode], mode == "mean")
    ref = torch.from_numpy(SentenceTransformer(path, device="cpu").encode(TEXTS, batch_size=len(TEXTS)))
    model = _load(path)
    ours = model.pool_prompts(_ids(AutoTokenizer.from_pretrained(path), TEXTS), PoolerSpec(pooling_type))
    if normalize:
        ours = torch.nn.functional.normalize(ours, dim=-1)
    assert_close_rows(ours, ref, 0.9999, 1e-4)
    pack_linears_for_cpu(model, many_rows=model.encoder_parts())
    packed = model.pool_prompts(_ids(AutoTokenizer.from_pretrained(path), TEXTS), PoolerSpec(pooling_type))
    assert_close_rows(torch.nn.functional.normalize(packed, dim=-1) if normalize else packed, ref, 0.9999, 1e-4)


def test_embedder_bf16_stays_close(embedder):
    path, _ = embedder
    model = _load(path, "bfloat16")
    assert model.bert.embeddings.word_embeddings.weight.dtype == torch.bfloat16
    pack_linears_for_cpu(model, many_rows=model.encoder_parts())
    ours = model.pool_prompts(_ids(AutoTokenizer.from_pretrained(path), TEXTS), PoolerSpec("MEAN"))
    assert_close_rows(ours, hf_pooled(path, TEXTS, "MEAN"), 0.999, 0.05)


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS", "LAST"])
def test_embedder_on_3_and_60_tokens_matches_hf(embedder, pooling_type):
    """One varlen batch of very different lengths (no padding is computed) against HF's padded batch."""
    path, _ = embedder
    words = "the quick brown fox jumps over the lazy dog on the mat".split() * 5
    texts = ["hello", " ".join(words[:58])]  # [CLS] + 1 / 58 words + [SEP]
    ids = _ids(AutoTokenizer.from_pretrained(path), texts)
    assert [len(t) for t in ids] == [3, 60]
    ours = _load(path).pool_prompts(ids, PoolerSpec(pooling_type))
    assert_close_rows(ours, hf_pooled(path, texts, pooling_type), 0.9999, 1e-4)


def test_text_pair_token_types_match_the_tokenizer(cross_encoder):
    tokenizer = AutoTokenizer.from_pretrained(cross_encoder)
    assert sep_token_id_of(AutoConfig.from_pretrained(cross_encoder)) == tokenizer.sep_token_id
    encodings = [tokenizer(q, d) for q, d in PAIRS] + [tokenizer(t) for t in TEXTS]
    ids = [torch.tensor(e["input_ids"]) for e in encodings]
    segments = Segments(ids, tokenizer.sep_token_id, 2)
    assert segments.token_types.tolist() == [t for e in encodings for t in e["token_type_ids"]]
    assert any(t == 1 for e in encodings for t in e["token_type_ids"])  # the pairs do have a second segment


def test_cross_encoder_logits_match_hf(cross_encoder):
    from transformers import BertForSequenceClassification as HFClassifier

    tokenizer = AutoTokenizer.from_pretrained(cross_encoder)
    hf = HFClassifier.from_pretrained(cross_encoder, dtype=torch.float32).eval()
    batch = tokenizer([q for q, _ in PAIRS], [d for _, d in PAIRS], padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any() and (batch["token_type_ids"] == 1).any()
    with torch.no_grad():
        ref = hf(**batch).logits  # [N, 1]
    assert ref.std().item() > 0.05  # the pairs score differently
    model = _load(cross_encoder)
    ours = model.pool_prompts(_pair_ids(tokenizer, PAIRS), CLASSIFY)
    assert ours.shape == (len(PAIRS), 1) and ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() <= 1e-4


def test_cross_encoder_scores_match_sentence_transformers(cross_encoder):
    from sentence_transformers import CrossEncoder

    ref = torch.from_numpy(CrossEncoder(cross_encoder, device="cpu").predict(PAIRS, batch_size=len(PAIRS)))  # [N]
    model = _load(cross_encoder)
    pack_linears_for_cpu(model, many_rows=model.encoder_parts())
    logits = model.pool_prompts(_pair_ids(AutoTokenizer.from_pretrained(cross_encoder), PAIRS), CLASSIFY)
    scores = torch.sigmoid(logits[:, 0])  # CrossEncoder's default activation for one label
    assert (scores - ref.float()).abs().max().item() <= 1e-4
    bf16 = _load(cross_encoder, "bfloat16")
    pack_linears_for_cpu(bf16, many_rows=bf16.encoder_parts())
    low = torch.sigmoid(
        bf16.pool_prompts(_pair_ids(AutoTokenizer.from_pretrained(cross_encoder), PAIRS), CLASSIFY)[:, 0]
    )
    assert (low - ref.float()).abs().max().item() <= 1e-2


def test_classifier_embeds_and_embedder_refuses_classify(cross_encoder, embedder):
    """A cross-encoder asked to embed (convert="embed") gives its pooled last hidden states; an embedder has no
    classifier head to classify with."""
    from transformers import BertModel

    tokenizer = AutoTokenizer.from_pretrained(cross_encoder)
    trunk = BertModel.from_pretrained(cross_encoder, dtype=torch.float32).eval()  # the classifier's `bert.*`
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = trunk(**batch).last_hidden_state[:, 0]  # [N, E]
    ours = _load(cross_encoder).pool_prompts(_ids(tokenizer, TEXTS), PoolerSpec("CLS", True, "embed"))
    assert_close_rows(ours, ref, 0.9999, 1e-4)
    with pytest.raises(ValueError, match="no classifier head"):
        _load(embedder[0]).pool_prompts(_ids(tokenizer, TEXTS), CLASSIFY)


def test_several_labels_match_hf(tmp_path):
    from transformers import BertForSequenceClassification as HFClassifier

    path = build_bert_cross_encoder(str(tmp_path), num_labels=3, seed=5)
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = HFClassifier.from_pretrained(path, dtype=torch.float32).eval()
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = hf(**batch).logits  # [N, 3]
    ours = _load(path).pool_prompts(_ids(tokenizer, TEXTS), CLASSIFY)
    assert ours.shape == (len(TEXTS), 3)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_bad_prompts_are_refused(cross_encoder):
    model = _load(cross_encoder)
    spec = CLASSIFY
    ok = torch.tensor([2, 10, 3])
    cases = {
        "non-empty list": [],
        "non-empty 1-D": [torch.tensor([[2, 3]])],
        "must be integers": [ok.float()],
        "must lie in": [torch.tensor([2, 10_000, 3])],
        "exceeds the 64 positions": [torch.full((65,), 10)],
    }
    for message, prompts in cases.items():
        with pytest.raises(ValueError, match=message):
            model.pool_prompts(prompts, spec)
    with pytest.raises(ValueError, match="pools CLS, MEAN, LAST"):
        model.pool_prompts([ok], PoolerSpec("ALL", False, "classify"))
    with pytest.raises(ValueError, match="no language-model head"):
        model.pool_prompts([ok], PoolerSpec("CLS", False, "classify", (5, 6)))
    with pytest.raises(TypeError, match="pool_prompts"):
        model(ok)


def test_checkpoint_problems_are_refused(tmp_path, cross_encoder):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "no_pooler"
    shutil.copytree(cross_encoder, broken)
    tensors = load_file(broken / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith("bert.pooler.")}, broken / "model.safetensors")
    with pytest.raises(ValueError, match="checkpoint lacks 2 weight"):
        _load(str(broken))
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{cross_encoder}/{name}", no_tokenizer / name)
    with pytest.raises(ValueError, match="sep_token_id"):
        _load(str(no_tokenizer))
    with open(no_tokenizer / "config.json") as f:
        config = json.load(f)
    with open(no_tokenizer / "config.json", "w") as f:
        json.dump(config | {"sep_token_id": 3}, f)
    assert _load(str(no_tokenizer)).sep_token_id == 3  # a config that states it needs no tokenizer
    relative = tmp_path / "relative"
    shutil.copytree(no_tokenizer, relative)
    with open(relative / "config.json", "w") as f:
        json.dump(config | {"sep_token_id": 3, "position_embedding_type": "relative_key"}, f)
    with pytest.raises(ValueError, match="position_embedding_type"):
        _load(str(relative))
