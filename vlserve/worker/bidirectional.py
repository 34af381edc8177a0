"""Per-token attention key limits for models whose image tokens attend bidirectionally within one image (Gemma 3).

HF's rule: the tokens of one contiguous run of the image token attend to each other both ways in the prompt; every
other token stays causal. As a key limit per query token: a token inside a run at positions a..b may attend keys up
to b, any other token up to its own position (`AttentionMetadata.key_limits`; a sliding window still counts back
from the query's own position). The scheduler keeps a run inside one step (`unsplit_mm_items`), so key b is written
in the same step as the query that needs it.
"""

from __future__ import annotations

import numpy as np
import torch

from vlserve.kernels.host_copy import to_device


def token_runs(token_ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """The maximal runs of `token_id` in `token_ids` as (first, last) positions, in order."""
    runs: list[tuple[int, int]] = []
    start = None
    for pos, tok in enumerate(token_ids):
        if tok == token_id:
            if start is None:
                start = pos
        elif start is not None:
            runs.append((start, pos - 1))
            start = None
    if start is not None:
        runs.append((start, len(token_ids) - 1))
    return runs


def step_key_limits(
    runs_per_row: list[list[tuple[int, int]]],
    starts: np.ndarray,
    q_lens: np.ndarray,
    cu: np.ndarray,
    positions: np.ndarray,
    device: torch.device,
) -> torch.Tensor | None:
    """The step's key limits `[T]` int64 (`positions [T]`: each flat token's own position, the step's), or None
    when no row's window reaches a run (causal everywhere).

    Row i's tokens sit at flat indices cu[i] .. cu[i] + q_lens[i] - 1 and positions starts[i] + j. ValueError when a
    run ends past the row's window (its last keys would not be written yet: the scheduler split it)."""
    limits: np.ndarray | None = None
    for i, runs in enumerate(runs_per_row):
        if not runs or q_lens[i] <= 1:  # decodes never sit inside a prompt's image run
            continue
        s, n, row = int(starts[i]), int(q_lens[i]), int(cu[i])
        for first, last in runs:
            if last < s or first >= s + n:
                continue
            if last >= s + n:
                raise ValueError(
                    f"an image run at positions {first}..{last} is cut by the step's window "
                    f"{s}..{s + n - 1}; bidirectional image attention needs the whole run in one step"
                )
            if limits is None:
                limits = positions.astype(np.int64, copy=True)
            lo = max(first, s)
            limits[row + lo - s : row + last - s + 1] = last
    return None if limits is None else to_device(torch.from_numpy(limits), device)
