"""The runner's half of structured outputs: the int32 token bitmask unpacks to the right tokens and only the
constrained requests' rows (drafts' rows included) lose their forbidden tokens."""

import numpy as np
import torch

from vlserve.worker.grammar_mask import apply_grammar_bitmask, unpack_bitmask


def _pack(allowed: list[set[int]], vocab: int) -> np.ndarray:
    words = (vocab + 31) // 32
    out = np.zeros((len(allowed), words), dtype=np.uint32)
    for r, toks in enumerate(allowed):
        for t in toks:
            out[r, t // 32] |= np.uint32(1 << (t % 32))
    return out.view(np.int32)


def test_unpack_matches_the_bits_including_bit_31_and_the_tail():
    vocab = 70
    rows = [{0, 31, 32, 63, 69}, set(), set(range(vocab))]
    got = unpack_bitmask(_pack(rows, vocab), vocab)
    for r, toks in enumerate(rows):
        assert set(torch.nonzero(got[r]).flatten().tolist()) == toks
    wider = unpack_bitmask(_pack(rows, vocab), 100)  # logits wider than the bitmask
    assert not wider[:, 96:].any()


def test_only_constrained_rows_are_masked():
    vocab = 40
    logits = torch.randn(5, vocab)  # rows: a (1 row), b (2 drafts + bonus), c (1 row)
    before = logits.clone()
    mask = _pack([{3}, {4, 5}, {6}], vocab)  # b's three rows (two drafts, then its bonus) at rows 0..2
    apply_grammar_bitmask(logits, mask, {"b": 0}, ["a", "b", "c"], [1, 3, 1])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[4], before[4])
    for row, toks in zip((1, 2, 3), ({3}, {4, 5}, {6})):
        finite = set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist())
        assert finite == toks
        assert torch.equal(logits[row, sorted(toks)], before[row, sorted(toks)])


def test_all_rows_constrained_in_place():
    vocab = 33
    logits = torch.zeros(2, vocab, dtype=torch.bfloat16)
    apply_grammar_bitmask(logits, _pack([{32}, {0, 1}], vocab), {"x": 0, "y": 1}, ["x", "y"], [1, 1])
    assert logits[0].argmax().item() == 32 and torch.isinf(logits[0, :32]).all()
    assert set(torch.nonzero(torch.isfinite(logits[1])).flatten().tolist()) == {0, 1}


def test_rows_in_another_order_than_the_bitmask():
    """The runner orders requests (decodes first) unlike the scheduler: every row must take its own mask row."""
    vocab = 40
    logits = torch.zeros(2, vocab)
    apply_grammar_bitmask(logits, _pack([{1}, {2}], vocab), {"x": 0, "y": 1}, ["y", "x"], [1, 1])
    assert logits[0].argmax().item() == 2 and logits[1].argmax().item() == 1
    assert torch.isfinite(logits).sum().item() == 2


def test_word_level_masking_equals_bit_by_bit():
    """All-allowed, all-forbidden and mixed words, a vocabulary that is not a multiple of 32, bf16 and float32."""
    rng = np.random.default_rng(0)
    for vocab, dtype in ((151, torch.float32), (160, torch.bfloat16), (1000, torch.float32)):
        words = (vocab + 31) // 32
        mask = rng.integers(-(2**31), 2**31 - 1, size=(6, words), dtype=np.int64).astype(np.int32)
        mask[0] = -1
        mask[1] = 0
        mask[2, ::2] = 0
        mask[3, 1::2] = -1
        logits = torch.randn(6, vocab).to(dtype)
        expected = logits.masked_fill(~unpack_bitmask(mask, vocab), float("-inf"))
        apply_grammar_bitmask(logits, mask, {str(i): i for i in range(6)}, [str(i) for i in range(6)], [1] * 6)
        assert torch.equal(logits, expected)
