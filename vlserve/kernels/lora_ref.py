"""The torch twin of punica's LoRA kernels (vLLM's `bgmv_shrink` / `bgmv_expand_slice` and their segmented
`sgmv_*` forms), over per-slot stacked weights:

- `lora_a [L, R, I]`: slot l's A, its rank zero-padded up to R (`L` = max_loras, `R` = max_lora_rank);
- `lora_b [L, O, R]`: slot l's B (scaling folded in), zero-padded the same way;
- `token_slots [T]` int64: the slot of each token of the step, -1 for none (the base model).

`shrink` computes `x @ A[slot]^T` -> `[n, r]`, `expand_slice` adds `y @ B[slot]^T` into a column slice of the
output. The layers use the grouped path: the step's tokens are grouped by slot once (`token_groups`; a request's
tokens are contiguous, so a group is usually a slice) and each active slot costs one shrink and one expand matmul
per output slice. `bgmv_shrink` / `bgmv_expand_slice` are the per-token forms (each token gathers its own
matrices), kept as the reference the grouped path is tested against and as the spec a fused kernel must meet.
"""

from __future__ import annotations

import torch


def token_groups(token_slots: torch.Tensor) -> tuple[tuple[int, object], ...]:
    """`token_slots [T]` -> `((slot, rows), ...)` for every slot >= 0 present, in slot order; rows is a `slice`
    when the slot's tokens are contiguous, else an int64 index tensor `[n]` (on token_slots' device)."""
    slots = token_slots.to("cpu", torch.int64)
    groups = []
    for slot in torch.unique(slots[slots >= 0]).tolist():
        idx = torch.nonzero(slots == slot).squeeze(1)  # [n]
        first, last = int(idx[0]), int(idx[-1])
        if last - first + 1 == idx.numel():
            groups.append((slot, slice(first, last + 1)))
        else:
            groups.append((slot, idx.to(token_slots.device)))
    return tuple(groups)


def take_rows(x: torch.Tensor, rows) -> torch.Tensor:
    """`x [T, ...]` -> the group's rows `[n, ...]` (a view for a slice)."""
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def shrink(x: torch.Tensor, lora_a: torch.Tensor, slot: int, rank: int) -> torch.Tensor:
    """`x [n, I]` (one group's rows) @ `A[slot, :rank]^T` -> `[n, rank]` (the padding past `rank` is skipped)."""
    return x @ lora_a[slot, :rank].t()


def expand_slice(
    y: torch.Tensor, lora_b: torch.Tensor, slot: int, rank: int, out: torch.Tensor, rows, offset: int
) -> None:
    """Add `y [n, rank] @ B[slot, :, :rank]^T` (`[n, O_s]`) into `out[rows, offset:offset + O_s]` in place."""
    b = lora_b[slot, :, :rank]  # [O_s, rank]
    delta = (y @ b.t()).to(out.dtype)  # [n, O_s]
    cols = out[:, offset : offset + b.shape[0]]  # a view of out: [T, O_s]
    if isinstance(rows, slice):
        cols[rows] += delta
    else:
        cols.index_add_(0, rows, delta)


def add_lora_grouped(
    x: torch.Tensor,
    out: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    offsets: list[int],
    ranks: list[list[int]],
    groups,
) -> None:
    """The fused-layer op: for each `(slot, rows)` group and each output slice s with `ranks[slot][s] > 0`,
    `out[rows, offsets[s]:...] += x[rows] @ A_s[slot]^T @ B_s[slot]^T`. `x [T, I]`, `out [T, O]`, `lora_a[s]
    [L, R, I]`, `lora_b[s] [L, O_s, R]`. Rows of no group (and slices without weights) are not touched."""
    for slot, rows in groups:
        slot_ranks = ranks[slot]
        if not any(slot_ranks):
            continue
        xs = take_rows(x, rows).to(lora_a[0].dtype)  # [n, I]
        for a, b, offset, rank in zip(lora_a, lora_b, offsets, slot_ranks):
            if rank:
                expand_slice(shrink(xs, a, slot, rank), b, slot, rank, out, rows, offset)


# ---- per-token reference (bgmv) ---------------------------------------------------------------------------------


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Per token: `x [T, I]` -> `[T, R]` = `scale * x[t] @ A[slot_t]^T`, zero rows where slot_t < 0."""
    picked = lora_a[token_slots.clamp(min=0)]  # [T, R, I]
    y = torch.einsum("ti,tri->tr", x.to(lora_a.dtype), picked) * scale  # [T, R]
    return y.masked_fill((token_slots < 0).unsqueeze(1), 0)


def bgmv_expand_slice(
    y: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor, offset: int
) -> None:
    """Per token: `out[t, offset:offset + O_s] += y[t] @ B[slot_t]^T` for slot_t >= 0 (`y [T, R]`, `out [T, O]`)."""
    picked = lora_b[token_slots.clamp(min=0)]  # [T, O_s, R]
    delta = torch.einsum("tr,tor->to", y, picked)  # [T, O_s]
    keep = token_slots >= 0
    out[keep, offset : offset + lora_b.shape[1]] += delta[keep].to(out.dtype)
