"""Tiny random BERT checkpoints for the BERT tests: a real WordPiece tokenizer (`BertTokenizerFast` over a small
vocabulary written here), an HF `BertModel` saved as a sentence-transformers embedder (modules.json, 1_Pooling,
optionally 2_Normalize, written by sentence-transformers itself), and an HF `BertForSequenceClassification` saved
as a cross-encoder. Weights are drawn wider than HF's init (std 0.02) so that poolings, token types and heads
change the results visibly."""

from __future__ import annotations

import os

import torch

WORDS = (
    "the a an is of on in to and what where who capital city france paris berlin germany cat dog sat mat quick "
    "brown fox jumps over lazy hello world river bank money search engine query document relevant"
).split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"

TEXTS = [
    "What is the capital of France?",
    "hello",
    "The quick brown fox jumps over the lazy dog on the mat",
    "a zebra sat by the river bank",  # "zebra" is split into word pieces
]
PAIRS = [
    ("what is the capital of france", "paris is the capital of france"),
    ("what is the capital of france", "the lazy dog sat on the mat"),
    ("river bank", "money in a bank"),
    ("hello", "a quick search engine query for a relevant document about berlin and germany"),
]
TINY_BERT = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64
)


def bert_tokenizer(path: str):
    """A BertTokenizerFast over a small WordPiece vocabulary (specials, the words above, letters and ## pieces,
    punctuation), read from the vocab.txt written under `path` (as a checkpoint directory holds it: transformers 5's
    constructor takes a `vocab` where 4.x took `vocab_file`)."""
    from transformers import BertTokenizerFast

    vocab = list(dict.fromkeys(SPECIAL + WORDS + list(LETTERS) + ["##" + c for c in LETTERS] + list(".,?!'")))
    os.makedirs(path, exist_ok=True)
    vocab_file = os.path.join(path, "vocab.txt")
    with open(vocab_file, "w") as f:
        f.write("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast.from_pretrained(path)
    assert len(tokenizer) == len(vocab), "the tokenizer did not read vocab.txt"
    return tokenizer


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter: matrices and biases N(0, 0.3), LayerNorm weights around 1."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        param.copy_(1 + 0.1 * noise if name.endswith("LayerNorm.weight") else 0.3 * noise)


def _config(tokenizer, **overrides):
    from transformers import BertConfig

    return BertConfig(vocab_size=len(tokenizer), **TINY_BERT, **overrides)


def build_bert_embedder(path: str, pooling_mode: str = "mean", normalize: bool = True, seed: int = 0) -> str:
    """Save a sentence-transformers embedder (BertModel + Pooling(`pooling_mode`) [+ Normalize]) at `path`, as
    `SentenceTransformer.save` writes it; returns `path`."""
    from sentence_transformers import SentenceTransformer
    from transformers import BertModel

    try:  # sentence-transformers 6 (its `models` module is deprecated there)
        from sentence_transformers.sentence_transformer import modules as models
    except ImportError:
        from sentence_transformers import models

    hf_dir = os.path.join(path, "_hf")
    tokenizer = bert_tokenizer(hf_dir)
    model = BertModel(_config(tokenizer))
    randomize_(model, seed)
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    modules = [models.Transformer(hf_dir), models.Pooling(TINY_BERT["hidden_size"], pooling_mode=pooling_mode)]
    SentenceTransformer(modules=modules + ([models.Normalize()] if normalize else []), device="cpu").save(path)
    return path


def build_bert_cross_encoder(path: str, num_labels: int = 1, seed: int = 1) -> str:
    """Save an HF BertForSequenceClassification (the cross-encoder layout: `bert.*`, `bert.pooler.dense`,
    `classifier`) and its tokenizer at `path`; returns `path`."""
    from transformers import BertForSequenceClassification

    tokenizer = bert_tokenizer(path)
    model = BertForSequenceClassification(_config(tokenizer, num_labels=num_labels))
    randomize_(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
