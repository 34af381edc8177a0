"""Applying structured outputs' token bitmask to a step's logits (the runner's half of constrained decoding): the
C++ pass of `vlserve.kernels.grammar_mask` for CPU logits where it is built, numpy's unpack + `masked_fill`
otherwise (GPU logits, no compiler)."""

from __future__ import annotations

import numpy as np
import torch

from vlserve.kernels.grammar_mask import (
    apply_token_bitmask_cpu,
    apply_token_bitmask_ref,
    grammar_mask_supported,
    unpack_bitmask,
)

__all__ = ["apply_grammar_bitmask", "unpack_bitmask"]


def apply_grammar_bitmask(
    logits: torch.Tensor, bitmask: np.ndarray, first_row: dict[str, int], req_ids: list[str], num_rows: list[int]
) -> None:
    """Set the logits of tokens a grammar forbids to -inf, in place. logits: [sum(num_rows), V], request i owning
    num_rows[i] consecutive rows (its drafts' positions, then its bonus position); bitmask: int32 [R, W] with the
    same per-request row layout starting at first_row[req_id], for constrained requests only."""
    logit_rows: list[int] = []
    mask_rows: list[int] = []
    base = 0
    for rid, n in zip(req_ids, num_rows):
        start = first_row.get(rid)
        if start is not None:
            logit_rows.extend(range(base, base + n))
            mask_rows.extend(range(start, start + n))
        base += n
    if not logit_rows:
        return
    # every logit row taking the bitmask row of the same index: no row mapping
    identity = len(logit_rows) == logits.shape[0] == bitmask.shape[0] and all(
        lr == i and mr == i for i, (lr, mr) in enumerate(zip(logit_rows, mask_rows))
    )
    if grammar_mask_supported(logits):
        if identity:
            apply_token_bitmask_cpu(logits, bitmask)
        else:
            apply_token_bitmask_cpu(logits, bitmask, logit_rows, mask_rows)
        return
    in_order = len(mask_rows) == bitmask.shape[0] and all(r == i for i, r in enumerate(mask_rows))
    apply_token_bitmask_ref(
        logits, bitmask, None if len(logit_rows) == logits.shape[0] else logit_rows, None if in_order else mask_rows
    )
