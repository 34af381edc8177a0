"""Applying structured outputs' token bitmask to a step's logits (the runner's half of constrained decoding)."""
from __future__ import annotations

import numpy as np
import torch

def unpack_bitmask(words: np.ndarray, vocab_size: int) -> torch.Tensor:
    """int32 words [R, W] (bit j of word w: token 32 * w + j is allowed) -> bool [R, vocab_size]; tokens past the
    bitmask's width are not allowed. Unpacked by numpy from the words' bytes (little-endian hosts)."""
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=1, bitorder="little")  # [R, 32 W]
    if bits.shape[1] >= vocab_size:
        return torch.from_numpy(bits[:, :vocab_size]).to(torch.bool)
    padded = np.zeros((bits.shape[0], vocab_size), dtype=np.uint8)
    padded[:, :bits.shape[1]] = bits
    return torch.from_numpy(padded).to(torch.bool)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray, first_row: dict[str, int],
                          req_ids: list[str], num_rows: list[int]) -> None:
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
    in_order = len(mask_rows) == bitmask.shape[0] and all(r == i for i, r in enumerate(mask_rows))
    words = bitmask if in_order else bitmask[mask_rows]  # [r, W]
    allowed = unpack_bitmask(words, logits.shape[-1]).to(logits.device)  # [r, V]
    if len(logit_rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    rows = torch.tensor(logit_rows, dtype=torch.long, device=logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
