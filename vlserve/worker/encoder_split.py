"""A step's media items divided among the tensor-parallel ranks (`mm_encoder_tp_mode="data"`): the tower stays
whole on every rank, each rank encodes its share of the items, and an all-gather hands every rank every item's
embeddings in the original order.

`balance_items` is the split (greedy by size: the largest item first, each to the rank with the fewest embeddings so
far); `gather_item_embeddings` the hand-back (each rank's rows padded to the largest share, gathered, trimmed).
Every rank computes the same split from the same sizes, so no sizes travel; only when some rank has no item does a
small header (row width, dtype) go round first, so that rank knows the shape of what it receives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vlserve.distributed.communication import tp_all_gather
from vlserve.distributed.parallel_state import tp_rank, tp_size

# dtypes an embedding row may have, by the code the header carries
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def balance_items(sizes: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Item indices per rank (ascending within a rank), so that the ranks' summed sizes are close: items taken from
    the largest (ties: the lower index), each given to the rank with the least so far (ties: the lower rank)."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    loads = [0] * num_ranks
    owned: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        owned[rank].append(i)
        loads[rank] += sizes[i]
    return [sorted(items) for items in owned]


def _row_layout(local: torch.Tensor | None, device: torch.device) -> tuple[int, torch.dtype]:
    """(row width, dtype) of the embeddings, agreed over the ranks: those with rows tell the others (one gather of
    a `[2]` int64 header per rank)."""
    header = torch.zeros(1, 2, dtype=torch.int64, device=device)  # [1, 2]: width, dtype code (width 0: no rows)
    if local is not None:
        header[0, 0], header[0, 1] = local.shape[1], _DTYPES.index(local.dtype)
    headers = tp_all_gather(header, dim=0).tolist()  # [tp, 2]
    width, code = next(h for h in headers if h[0] > 0)
    return width, _DTYPES[code]


def gather_item_embeddings(
    local: torch.Tensor | None, lengths: Sequence[int], owned: list[list[int]], device: torch.device
) -> list[torch.Tensor]:
    """Every item's embeddings `[lengths[i], W]`, in item order, on every rank. `local` holds this rank's items'
    rows (`owned[rank]`, concatenated in that order; None when it owns none); `owned` is the split of all ranks."""
    rows_of = [sum(lengths[i] for i in items) for items in owned]
    max_rows = max(rows_of)
    if any(not items for items in owned):  # (the same answer on every rank: the split is everyone's)
        width, dtype = _row_layout(local, device)
    else:
        width, dtype = local.shape[1], local.dtype
    padded = torch.zeros(max_rows, width, dtype=dtype, device=device)  # [max_rows, W]
    if local is not None:
        padded[: local.shape[0]] = local
    gathered = tp_all_gather(padded, dim=0)  # [tp * max_rows, W], rank r's rows from r * max_rows
    out: list[torch.Tensor | None] = [None] * len(lengths)
    for rank, items in enumerate(owned):
        start = rank * max_rows
        for i in items:
            out[i] = gathered[start : start + lengths[i]]  # [lengths[i], W]
            start += lengths[i]
    return out  # type: ignore[return-value]


def encode_across_ranks(
    encode: Callable[[list[int]], torch.Tensor], lengths: Sequence[int], device: torch.device
) -> list[torch.Tensor]:
    """Encode items split over this tensor-parallel group: `encode(indices)` runs the tower on those items (their
    data concatenated in that order) -> `[sum of their lengths, W]`; each rank calls it once for its share (not
    at all for none). Returns every item's `[lengths[i], W]` in item order (views of one gathered buffer)."""
    owned = balance_items(lengths, tp_size())
    mine = owned[tp_rank()]
    local = encode(mine) if mine else None
    if local is not None and local.shape[0] != sum(lengths[i] for i in mine):
        raise RuntimeError(
            f"encoder produced {local.shape[0]} embeddings for items of {[lengths[i] for i in mine]} tokens"
        )
    return gather_item_embeddings(local, lengths, owned, device)
