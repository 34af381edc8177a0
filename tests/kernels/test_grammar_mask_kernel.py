"""The C++ grammar bitmask pass (`kernels.grammar_mask`) against the numpy + torch reference, bit for bit: all-allowed,
all-forbidden and mixed rows, bitmasks narrower and wider than the vocabulary, row mappings, each logits dtype, a
row split over threads; and the runner's `apply_grammar_bitmask` taking it for CPU logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlserve.kernels.grammar_mask import (
    DISABLE_ENV,
    apply_token_bitmask_cpu,
    apply_token_bitmask_ref,
    grammar_mask_kernel,
    grammar_mask_supported,
)
from vlserve.worker import grammar_mask as worker_grammar_mask
from vlserve.worker.grammar_mask import apply_grammar_bitmask

pytestmark = pytest.mark.skipif(grammar_mask_kernel() is None, reason="no C++ toolchain for the grammar mask pass")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """x's raw bits as integers (so -inf, NaN and signed zeros compare exactly)."""
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16)


def _mask(rows: int, words: int, seed: int) -> np.ndarray:
    """int32 [rows, words]: cycles through all-allowed, all-forbidden, random, runs of both kinds, a few allowed
    tokens (a JSON string's start) and most allowed."""
    rng = np.random.default_rng(seed)
    mask = rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    for r in range(rows):
        kind = r % 6
        if kind == 0:
            mask[r] = -1
        elif kind == 1:
            mask[r] = 0
        elif kind == 3:  # runs of zero and all-ones words around mixed ones
            mask[r, rng.random(words) < 0.4] = 0
            mask[r, rng.random(words) < 0.4] = -1
        elif kind == 4:
            mask[r] = 0
            for t in rng.choice(32 * words, size=min(5, 32 * words), replace=False):
                mask[r, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        elif kind == 5:
            mask[r] = -1
            mask[r, rng.integers(0, words, size=max(1, words // 20))] = rng.integers(-(2**31), 2**31, dtype=np.int64)
    return mask


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)  # [rows, vocab]
    logits.view(-1)[::97] = float("nan")  # masked_fill replaces them where forbidden and keeps them where allowed
    logits.view(-1)[5::89] = float("inf")
    return logits.to(dtype)


# vocab vs the bitmask's 32 W tokens: a multiple of 32, a partial last word, narrower (the tail is forbidden) and wider
# (its extra words are ignored)
@pytest.mark.parametrize(
    "vocab,words",
    [(64, 2), (689, 22), (689, 15), (689, 40), (700, 1), (5000, 157), (151936, 4748), (151937, 4748), (151936, 4000)],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_rows_match_the_reference(vocab, words, dtype):
    mask = _mask(12, words, seed=vocab + words)
    logits = _logits(12, vocab, dtype, seed=1)
    want = logits.clone()
    apply_token_bitmask_ref(want, mask)
    apply_token_bitmask_cpu(logits, mask)
    assert torch.equal(_bits(logits), _bits(want))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,words", [(689, 22), (151936, 4748), (40000, 900)])
def test_row_subsets_and_strided_logits(dtype, vocab, words):
    """Logit rows taking other mask rows (reordered, repeated, some rows unmasked), logits rows wider apart than V."""
    mask = _mask(9, words, seed=3)
    storage = _logits(7, vocab + 48, dtype, seed=4)
    logits = storage[:, :vocab]  # [7, vocab], rows vocab + 48 apart
    want = logits.clone()
    logit_rows, mask_rows = [0, 2, 3, 6], [8, 1, 5, 1]
    apply_token_bitmask_ref(want, mask, logit_rows, mask_rows)
    apply_token_bitmask_cpu(logits, mask, logit_rows, mask_rows)
    assert torch.equal(_bits(logits), _bits(want))
    assert torch.equal(_bits(storage[:, vocab:]), _bits(_logits(7, vocab + 48, dtype, seed=4)[:, vocab:]))


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("vocab,words", [(151936, 4748), (151936, 3001), (300001, 9400), (70000, 2188)])
def test_one_row_split_over_threads(threads, vocab, words):
    """Fewer rows than threads: each row's words are split into ranges; the bitmask's end and the vocabulary's last
    partial word fall inside or on a range's edge."""
    mask = _mask(6, words, seed=threads)
    for rows in ([3], [2, 4], [0, 1, 2]):  # runs of both kinds; random and few allowed; all, none, random
        logits = _logits(len(rows), vocab, torch.float32, seed=threads)
        want = logits.clone()
        apply_token_bitmask_ref(want, mask[rows])
        apply_token_bitmask_cpu(logits, mask, list(range(len(rows))), rows, threads=threads)
        assert torch.equal(_bits(logits), _bits(want))


@pytest.mark.parametrize("dtype", DTYPES)
def test_runner_mapping_uses_the_pass(dtype, monkeypatch):
    """`apply_grammar_bitmask`'s first_row / num_rows mapping (drafts' rows, unconstrained requests, requests in
    another order than the bitmask) through the C++ pass, equal to the reference path it takes with the pass off."""
    vocab, words = 151936, 4748
    mask = _mask(6, words, seed=7)
    req_ids, num_rows = ["a", "b", "c", "d"], [1, 3, 1, 2]
    first_row = {"d": 0, "b": 2, "a": 5}  # c is unconstrained; the bitmask holds d, then b, then a
    logits = _logits(sum(num_rows), vocab, dtype, seed=8)
    want = logits.clone()

    def no_reference(*args, **kwargs):
        raise AssertionError("the reference path ran for CPU logits")

    monkeypatch.setattr(worker_grammar_mask, "apply_token_bitmask_ref", no_reference)
    apply_grammar_bitmask(logits, mask, first_row, req_ids, num_rows)
    monkeypatch.undo()
    monkeypatch.setenv(DISABLE_ENV, "0")
    assert not grammar_mask_supported(want)
    apply_grammar_bitmask(want, mask, first_row, req_ids, num_rows)
    assert torch.equal(_bits(logits), _bits(want))
    assert torch.equal(_bits(logits[4]), _bits(_logits(sum(num_rows), vocab, dtype, seed=8)[4]))  # c's row


def test_runner_identity_mapping_and_pass_off(monkeypatch):
    """Every row constrained in bitmask order takes the unmapped call; with the pass off the reference runs."""
    mask = _mask(4, 22, seed=9)
    logits = _logits(4, 689, torch.float32, seed=10)
    want = logits.clone()
    apply_token_bitmask_ref(want, mask)
    calls = []
    monkeypatch.setattr(
        worker_grammar_mask,
        "apply_token_bitmask_cpu",
        lambda *args, **kwargs: calls.append(len(args)) or apply_token_bitmask_cpu(*args, **kwargs),
    )
    apply_grammar_bitmask(logits, mask, {str(i): i for i in range(4)}, [str(i) for i in range(4)], [1] * 4)
    assert calls == [2] and torch.equal(_bits(logits), _bits(want))
    monkeypatch.setenv(DISABLE_ENV, "0")
    off = _logits(4, 689, torch.float32, seed=10)
    apply_grammar_bitmask(off, mask, {str(i): i for i in range(4)}, [str(i) for i in range(4)], [1] * 4)
    assert calls == [2] and torch.equal(_bits(off), _bits(want))


def test_read_only_and_sliced_bitmasks():
    """Bitmask arrays that torch.from_numpy does not take as they are (read-only, columns sliced, rows reversed)."""
    mask = _mask(6, 30, seed=11)
    read_only = mask.copy()
    read_only.flags.writeable = False
    for bitmask in (read_only, mask[:, :25], mask[::-1]):
        logits = _logits(6, 800, torch.float32, seed=12)
        want = logits.clone()
        apply_token_bitmask_ref(want, np.ascontiguousarray(bitmask))
        apply_token_bitmask_cpu(logits, bitmask)
        assert torch.equal(_bits(logits), _bits(want))


def test_supported_and_argument_checks():
    assert grammar_mask_supported(torch.zeros(2, 40))
    assert not grammar_mask_supported(torch.zeros(2, 40, dtype=torch.float64))
    assert not grammar_mask_supported(torch.zeros(40, 2).t())  # no unit stride along V
    with pytest.raises(ValueError):
        apply_token_bitmask_cpu(torch.zeros(3, 40), np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(ValueError):
        apply_token_bitmask_cpu(torch.zeros(2, 40), np.zeros((2, 2), dtype=np.int64))
    empty = torch.zeros(0, 40)
    apply_token_bitmask_cpu(empty, np.zeros((0, 2), dtype=np.int32))  # nothing to mask: no call
