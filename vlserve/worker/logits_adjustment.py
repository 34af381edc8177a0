"""Per-request logits adjustments from SamplingParams, applied in one place before sampling (and before draft
verification): allowed_token_ids (every other id -> -inf), bad_words (the last token of a bad word whose prefix
ends the output so far -> -inf), then logit_bias (added). Built only for the rows of requests that use them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlserve.kernels.host_copy import tensor_to_device, to_device
from vlserve.sampling_params import SamplingParams


@dataclass
class LogitsAdjustment:
    """One step's adjustments, in logits-row coordinates (row i = params[i] of the batch)."""

    # allowed_token_ids: rows restricted [A] int64 and their allowed mask [A, V] bool (True = may be sampled)
    allowed_rows: torch.Tensor | None = None
    allowed_mask: torch.Tensor | None = None
    # bad words: logits[ban_rows, ban_token_ids] = -inf, [N] int64 each
    ban_rows: torch.Tensor | None = None
    ban_token_ids: torch.Tensor | None = None
    # logit_bias: logits[bias_rows, bias_token_ids] += bias_values, [M] int64 / int64 / float32
    bias_rows: torch.Tensor | None = None
    bias_token_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    reads_outputs: bool = False  # a bad word's ban depends on the output tokens (the rows change every step)


def bad_word_bans(bad_words: list[list[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The token ids a request may not sample next: each single-token bad word, and the last token of each longer
    one whose other tokens are the last output tokens (vLLM's rule; the prompt is not matched)."""
    banned = []
    n = len(output_token_ids)
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > n:
            continue
        if prefix == 0 or list(output_token_ids[n - prefix :]) == word[:prefix]:
            banned.append(word[-1])
    return banned


def build_logits_adjustment(
    params: list[SamplingParams], output_token_ids: Sequence[Sequence[int]], vocab_size: int, device
) -> LogitsAdjustment | None:
    """The adjustment of B rows (row i: params[i] after output_token_ids[i]), or None when no row has one."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return None
    adj = LogitsAdjustment()
    allowed = [i for i in rows if params[i].allowed_token_ids]
    if allowed:
        mask = torch.zeros(len(allowed), vocab_size, dtype=torch.bool)  # [A, V]
        for j, i in enumerate(allowed):
            mask[j, params[i].allowed_token_ids] = True
        adj.allowed_rows = tensor_to_device(allowed, torch.int64, device)
        adj.allowed_mask = to_device(mask, device)
    ban_r, ban_t = [], []
    for i in rows:
        words = params[i]._bad_words_token_ids
        if words:
            adj.reads_outputs = True
            banned = bad_word_bans(words, output_token_ids[i])
            ban_r.extend([i] * len(banned))
            ban_t.extend(banned)
    if ban_r:
        adj.ban_rows = tensor_to_device(ban_r, torch.int64, device)
        adj.ban_token_ids = tensor_to_device(ban_t, torch.int64, device)
    biased = [i for i in rows if params[i].logit_bias]
    if biased:
        adj.bias_rows = tensor_to_device(
            list(itertools.chain.from_iterable([i] * len(params[i].logit_bias) for i in biased)), torch.int64, device
        )
        adj.bias_token_ids = tensor_to_device(
            list(itertools.chain.from_iterable(params[i].logit_bias for i in biased)), torch.int64, device
        )
        adj.bias_values = tensor_to_device(
            list(itertools.chain.from_iterable(params[i].logit_bias.values() for i in biased)), torch.float32, device
        )
    return adj


def apply_logits_adjustment(logits: torch.Tensor, adj: LogitsAdjustment) -> None:
    """In place on float32 logits [B, V]: allowed ids, bad-word bans, then logit bias."""
    if adj.allowed_rows is not None:
        rows = logits.index_select(0, adj.allowed_rows)  # [A, V]
        logits.index_copy_(0, adj.allowed_rows, rows.masked_fill_(~adj.allowed_mask, float("-inf")))
    if adj.ban_rows is not None:
        logits[adj.ban_rows, adj.ban_token_ids] = float("-inf")
    if adj.bias_rows is not None:
        logits.index_put_((adj.bias_rows, adj.bias_token_ids), adj.bias_values, accumulate=True)
