"""The engine's half of the logits-adjustment fields: check logit_bias / allowed_token_ids against the vocabulary and
tokenize bad_words (vLLM's rule: each word alone and after a space, so it is banned at the start of the text and
inside it)."""

from __future__ import annotations

from dataclasses import replace

from vlserve.sampling_params import SamplingParams
from vlserve.shorten import shorten


def bad_words_token_ids(bad_words: list[str], tokenizer) -> list[list[int]]:
    """Token id sequences of each word: `word.lstrip()` and, when it tokenizes to a different first token but as
    many tokens, `" " + word.lstrip()`."""
    sequences: list[list[int]] = []
    for word in bad_words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if bare:
            sequences.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            sequences.append(spaced)
    return sequences


def bind_logits_fields(params: SamplingParams, tokenizer, vocab_size: int) -> SamplingParams:
    """`params` with bad_words tokenized; ValueError when a logit_bias or allowed_token_ids id is outside
    [0, vocab_size) or a bad word tokenizes to nothing."""
    for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids)):
        bad = [t for t in ids or () if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} holds token ids outside the vocabulary [0, {vocab_size}): {shorten(bad)}")
    if not params.bad_words:
        return params
    if tokenizer is None:
        raise ValueError("bad_words needs the model's tokenizer, and this engine has none")
    sequences = bad_words_token_ids(params.bad_words, tokenizer)
    if not sequences:
        raise ValueError(f"bad_words {shorten(params.bad_words)} tokenize to nothing")
    outside = [t for seq in sequences for t in seq if not 0 <= t < vocab_size]
    if outside:
        raise ValueError(f"bad_words tokenize to ids outside the vocabulary [0, {vocab_size}): {shorten(outside)}")
    return replace(params, _bad_words_token_ids=sequences)
