"""Incremental detokenization equals a full decode; stop strings cut at the earliest match."""

import itertools
import random

import pytest

from vlserve.demo.tokenizer import build_tokenizer
from vlserve.engine.byte_detok import ByteStream, ByteTable, _ends_unfinished
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


@pytest.mark.parametrize("skip", [True, False])
def test_byte_stream_emits_what_decode_stream_emits(tok, skip):
    """Random ids (added and special tokens, ids past the vocabulary, split and invalid UTF-8): token by token,
    the bytes table gives DecodeStream's pieces."""
    from tokenizers.decoders import DecodeStream

    backend = tok._tokenizer
    table = ByteTable.build(backend)
    assert table is not None
    added = list(backend.get_added_tokens_decoder())
    rng = random.Random(1)
    num_pieces = 0
    for _ in range(200):
        ref, fast = DecodeStream(skip_special_tokens=skip), ByteStream(table.bytes_of(skip))
        for _ in range(40):
            tid = rng.choice(added) if rng.random() < 0.1 else rng.randrange(len(tok) + 4)
            piece = ref.step(backend, tid) or ""
            assert fast.step(tid) == piece
            num_pieces += bool(piece)
    assert num_pieces > 1000


@pytest.mark.parametrize("chunk", [1, 3])
def test_byte_table_detokenizer_matches_decode_stream(tok, chunk):
    rng = random.Random(2)
    table = ByteTable.build(tok._tokenizer)
    for _ in range(30):
        prompt = [rng.randrange(len(tok)) for _ in range(8)]
        out = [rng.randrange(len(tok)) for _ in range(30)]
        a = IncrementalDetokenizer(tok, prompt, stop=["e"], byte_table=table)
        b = IncrementalDetokenizer(tok, prompt, stop=["e"])
        for i in range(0, len(out), chunk):
            assert a.update(out[i : i + chunk]) == b.update(out[i : i + chunk])
            assert a.output_text == b.output_text


def test_byte_stream_extend_joins_the_steps(tok):
    """`extend` over a run of ids gives the steps' pieces joined and leaves the same undecoded bytes, including
    runs that end inside a character or on an invalid byte."""
    table = ByteTable.build(tok._tokenizer).bytes_of(True)
    rng = random.Random(3)
    num_fallbacks = 0
    for _ in range(300):
        stepped, extended = ByteStream(table), ByteStream(table)
        for _ in range(6):
            ids = [rng.randrange(len(tok) + 4) for _ in range(rng.randrange(0, 8))]
            expected = "".join(stepped.step(t) for t in ids)
            assert extended.extend(ids) == expected
            assert extended.pending == stepped.pending
            num_fallbacks += bool(stepped.pending)
    assert num_fallbacks > 0  # (runs that left bytes undecoded)
    broken = [tid for tid, b in enumerate(table) if len(b) == 1 and 0x80 <= b[0] < 0xC0]  # lone continuation bytes
    assert broken
    letter = [tid for tid, b in enumerate(table) if b == b"a"]
    assert letter
    for tail in ([], broken[:1], letter):
        ids = [broken[i % len(broken)] for i in range(20)] + tail  # a long run of broken bytes, then a clean end or not
        stepped, extended = ByteStream(table), ByteStream(table)
        assert extended.extend(ids) == "".join(stepped.step(t) for t in ids)
        assert extended.pending == stepped.pending


def test_tail_check_equals_full_decode():
    """Whether a decode ends in U+FFFD, read from the last 4 bytes, is what decoding all the bytes says: every string
    of up to 4 bytes over UTF-8's boundary bytes, then longer random ones."""
    edge = [0x41, 0xC2, 0xDF, 0xE0, 0xE2, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBD, 0xBF, 0xC0]
    cases = [bytes(t) for n in range(1, 5) for t in itertools.product(edge, repeat=n)]
    rng = random.Random(5)
    cases += [bytes(rng.choice(edge) for _ in range(rng.randrange(5, 12))) for _ in range(20000)]
    mismatched = [d for d in cases if _ends_unfinished(d, len(d)) != d.decode("utf-8", "replace").endswith("\ufffd")]
    assert mismatched == []
    assert sum(_ends_unfinished(d, len(d)) for d in cases) > len(cases) // 4  # (both answers are common)
    assert _ends_unfinished(b"ab\xe2\x82\xac", 4) and not _ends_unfinished(b"ab\xe2\x82\xac", 5)


@pytest.mark.parametrize("read_every", [1, 4, 1000])
def test_queued_text_matches_decode_stream(tok, read_every):
    """Without stop strings the byte-table detokenizer queues ids; reading its text at any point gives what the
    DecodeStream one has after the same updates."""
    rng = random.Random(4)
    table = ByteTable.build(tok._tokenizer)
    for _ in range(30):
        prompt = [rng.randrange(len(tok)) for _ in range(8)]
        queued = IncrementalDetokenizer(tok, prompt, byte_table=table)
        streamed = IncrementalDetokenizer(tok, prompt)
        for i in range(40):
            ids = [rng.randrange(len(tok)) for _ in range(rng.choice([1, 1, 2]))]
            assert queued.update(ids) is None and streamed.update(ids) is None
            if i % read_every == 0:
                assert queued.output_text == streamed.output_text
        assert queued.output_text == streamed.output_text
