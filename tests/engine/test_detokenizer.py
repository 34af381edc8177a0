"""Incremental detokenization equals a full decode; stop strings cut at the earliest match."""

import random

import pytest

from vlserve.demo.tokenizer import build_tokenizer
from vlserve.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_equals_full_decode(tok, chunk):
    text = "Héllo wörld, the quick brown fox — 日本 ✓ done."
    ids = tok(text)["input_ids"]
    rng = random.Random(0)
    for trial in range(20):
        out = ids if trial == 0 else [rng.randrange(len(tok)) for _ in range(30)]
        d = IncrementalDetokenizer(tok, [5, 6, 7], skip_special_tokens=True)
        for i in range(0, len(out), chunk):
            d.update(out[i : i + chunk])
        full = tok.decode(out, skip_special_tokens=True)
        assert full.startswith(d.output_text)
        assert set(full[len(d.output_text) :]) <= {"\ufffd"}  # only a dangling partial character held back
        if trial == 0:
            assert d.output_text == text


def test_windowed_fallback_matches(tok):
    class SlowOnly:  # a tokenizer without the fast backend
        def __init__(self, t):
            self.t = t

        def decode(self, ids, skip_special_tokens=True):
            return self.t.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok("The quick brown fox jumps over the lazy dog")["input_ids"]
    d = IncrementalDetokenizer(SlowOnly(tok), [], skip_special_tokens=True)
    for t in ids:
        d.update([t])
    assert d.output_text == "The quick brown fox jumps over the lazy dog"


def test_stop_strings_earliest_wins(tok):
    ids = tok("alpha beta gamma delta")["input_ids"]
    d = IncrementalDetokenizer(tok, [], stop=["delta", "beta"])
    hit = None
    for t in ids:
        hit = hit or d.update([t])
    assert hit == "beta" and d.output_text == "alpha "
    d2 = IncrementalDetokenizer(tok, [], stop=["gamma"], include_stop_str_in_output=True)
    assert d2.update(ids) == "gamma" and d2.output_text == "alpha beta gamma"
