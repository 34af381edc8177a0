"""Helpers that read token bitmasks and walk a matcher to the end of its grammar, as a sampler would."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from vlserve.structured_output.backend import StructuredOutputGrammar, bitmask_words

DEMO_MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "vlserve", "demo", "model")
# A logits width past the tokenizer's 467 ids and not a multiple of 32, as real checkpoints pad theirs.
DEMO_VOCAB_SIZE = 500


def allowed_in_row(words: np.ndarray, vocab_size: int) -> list[int]:
    """The token ids whose bits are set in one bitmask row (int32 [words])."""
    bits = np.unpackbits(np.ascontiguousarray(words, dtype="<i4").view(np.uint8), bitorder="little")  # [32 * W]
    return np.flatnonzero(bits[:vocab_size]).tolist()


def mask_row(grammar: StructuredOutputGrammar, vocab_size: int) -> np.ndarray:
    """The grammar's next-token bitmask row (int32 [words]), filled over a row of -1 so a missed fill shows."""
    mask = torch.full((2, bitmask_words(vocab_size)), -1, dtype=torch.int32)  # [2, W]; row 1 checks the row index
    grammar.fill_bitmask(mask, 1)
    return mask[1].numpy().copy()


def allowed_tokens(grammar: StructuredOutputGrammar, vocab_size: int) -> list[int]:
    """The token ids the grammar allows next."""
    return allowed_in_row(mask_row(grammar, vocab_size), vocab_size)


def walk(
    grammar: StructuredOutputGrammar,
    vocab_size: int,
    eos_id: int,
    rng: random.Random | None,
    stop_chance: float = 0.5,
    max_tokens: int = 200,
) -> list[int]:
    """Sample tokens the grammar allows until it accepts EOS; returns the tokens before EOS.

    rng None: greedy, the lowest allowed id that is not EOS, stopping as soon as EOS is allowed. Otherwise a
    uniform pick among the allowed ids, taking EOS with stop_chance when it is allowed (always when it is the
    only one)."""
    tokens: list[int] = []
    for _ in range(max_tokens):
        allowed = allowed_tokens(grammar, vocab_size)
        assert allowed, f"the grammar allows no token after {tokens} and has not terminated"
        others = [t for t in allowed if t != eos_id]
        if eos_id in allowed and (not others or rng is None or rng.random() < stop_chance):
            assert grammar.accept_tokens([eos_id])
            assert grammar.is_terminated()
            return tokens
        token = others[0] if rng is None else rng.choice(others)
        assert grammar.accept_tokens([token]), f"the grammar refused token {token} its own bitmask allowed"
        assert not grammar.is_terminated()
        tokens.append(token)
    raise AssertionError(f"no EOS after {max_tokens} tokens: {tokens}")
