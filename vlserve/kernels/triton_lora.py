"""Triton LoRA kernels (punica's shrink / expand, our own code): a layer's adapter deltas for a step's tokens, each
token on its own adapter slot, in two launches and no host synchronisation.

What they compute, for every token t whose slot s_t is in [0, L) and every output slice q (q/k/v of qkv_proj,
gate/up of gate_up_proj, the whole output of o_proj/down_proj):

    shrink:  y[t, q*R:(q+1)*R]            = scale * x[t] @ A_q[s_t]^T          (zero rows for slot -1)
    expand:  out[t, off_q:off_q + O_q]   += y[t, q*R:(q+1)*R] @ B_q[s_t]^T     (rows of slot -1 untouched)

i.e. `lora_ref.bgmv_shrink` / `bgmv_expand_slice` (and `add_lora_grouped`, per token, for `add_lora_triton`).

Layouts (the layer's `lora_a` / `lora_b` lists, unchanged):
- `lora_a[q] [L, R, I]`, `lora_b[q] [L, O_q, R]`, any strides (views into one stacked tensor work: `lora_cpu`'s
  `LoRAStack.lora_a_views()` / `lora_b_views()`); ranks zero-padded up to R, so the kernels always use the full R
  (the padding adds exact zeros) and never read a per-slot rank;
- `y [T, S*R]` float32: slice q's shrink at columns q*R; `token_slots [T]` int32/int64, -1 for the base model.
Up to 3 slices go into one launch (a slice-grid axis picks its weight pointer, size, offset and slot stride); more
slices, or slices whose shared strides differ, take further launches.

How: `lora_token_blocks` orders the step's tokens by slot with torch ops on the device (stable argsort, counts by
scatter_add, cumsum, searchsorted) and pads every slot's run to a multiple of BLOCK_M: `rows [P]` (token ids, T on
padding) and `block_slot [P / BLOCK_M]` (the slot of each M-block, L past the used ones), where P = T + min(T, L) *
(BLOCK_M - 1) rounded up bounds any slot mix. A program then owns one M-block of one slot: a dense `tl.dot` tile
(gathered x rows times that slot's A tile over I; gathered y rows times a B tile over one BLOCK_N column block),
float32 accumulation, masked tails for I, R (padded to a power of two >= 16) and O_q. Blocks of no slot exit at once.
Every (token, column) of `out` has one writer and the shrink's optional split over I goes through float32 partials
summed by torch, so results are deterministic (no atomics).

Why no host sync: every shape (P, the grids, the buffers) follows from T, L, S, R, I, O and the block sizes, all
known on the host; the slot values only steer loads inside the kernels and the device-side ordering. The launches
can therefore be captured in a CUDA graph whose `token_slots` buffer is refilled before each replay (compute
`lora_token_blocks` inside the captured region, once per step, and pass it to every layer).

Where this has run: Triton's CPU interpreter (tests/kernels/test_triton_lora.py, against kernels.lora_ref) and, as a slow
test there, the sm_90 ahead-of-time compile (lowered to a cubin, never launched). Not yet executed on a GPU; the
tiles of `lora_config` are untuned guesses.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MIN_DOT = 16  # tl.dot needs every dimension >= 16
MAX_SLICES = 3  # weight pointers one launch carries


@triton.jit(do_not_specialize=["num_tokens"])
def _shrink_kernel(
    x_ptr,
    y_ptr,
    rows_ptr,
    block_slot_ptr,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    num_tokens,
    num_slots,
    rank,
    in_features,
    scale,
    stride_xt,
    stride_xi,
    stride_ys,
    stride_yt,
    stride_al,
    stride_ar,
    stride_ai,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    # x [T, I]; a_q [L, R, I]; y [SPLIT_K, T, S*R] float32 (slice q at column q*R, split k at y + k*stride_ys).
    # grid: (P / BLOCK_M, slices, SPLIT_K); program = one slot's M-block, one slice, one share of I.
    pid_m = tl.program_id(0)
    sid = tl.program_id(1)
    pid_k = tl.program_id(2)
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    if slot < num_slots:
        if sid == 0:
            a_ptr = a0_ptr
        elif sid == 1:
            a_ptr = a1_ptr
        else:
            a_ptr = a2_ptr
        tok = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M] token ids, T on padding
        valid = tok < num_tokens
        tok = tok.to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
        r_mask = offs_r < rank
        x_rows = x_ptr + tok[:, None] * stride_xt  # [BLOCK_M, 1]
        a_cols = a_ptr + slot * stride_al + offs_r[None, :] * stride_ar  # [1, BLOCK_R]
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(pid_k * BLOCK_K, in_features, BLOCK_K * SPLIT_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            k_mask = offs_k < in_features
            xt = tl.load(
                x_rows + offs_k[None, :] * stride_xi, mask=valid[:, None] & k_mask[None, :], other=0.0
            )  # [BLOCK_M, BLOCK_K]
            at = tl.load(
                a_cols + offs_k[:, None] * stride_ai, mask=k_mask[:, None] & r_mask[None, :], other=0.0
            )  # [BLOCK_K, BLOCK_R] = A[slot, r, k] transposed
            xt = xt.to(at.dtype)
            if UPCAST:
                # the interpreter's 16-bit dot is unreliable: multiply the 16-bit values in float32 instead
                acc = tl.dot(xt.to(tl.float32), at.to(tl.float32), acc, input_precision="ieee")
            elif FP32_DOT:
                acc = tl.dot(xt, at, acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, at, acc)
        y_ptrs = y_ptr + pid_k * stride_ys + tok[:, None] * stride_yt + (sid * rank + offs_r)[None, :]
        tl.store(y_ptrs, acc * scale, mask=valid[:, None] & r_mask[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _expand_kernel(
    y_ptr,
    out_ptr,
    rows_ptr,
    block_slot_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    num_tokens,
    num_slots,
    rank,
    size0,
    size1,
    size2,
    off0,
    off1,
    off2,
    stride_bl0,
    stride_bl1,
    stride_bl2,
    stride_yt,
    stride_yc,
    stride_ot,
    stride_oc,
    stride_bo,
    stride_br,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    # y [T, S*R]; b_q [L, O_q, R] (slot stride per slice, the other strides shared); out [T, O], slice q at off_q.
    # grid: (max_q cdiv(O_q, BLOCK_N), P / BLOCK_M, slices); program = one column block of one slice, one M-block.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    sid = tl.program_id(2)
    size = tl.where(sid == 0, size0, tl.where(sid == 1, size1, size2))
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    if (slot < num_slots) & (pid_n * BLOCK_N < size):
        if sid == 0:
            b_ptr = b0_ptr
        elif sid == 1:
            b_ptr = b1_ptr
        else:
            b_ptr = b2_ptr
        col0 = tl.where(sid == 0, off0, tl.where(sid == 1, off1, off2))
        stride_bl = tl.where(sid == 0, stride_bl0, tl.where(sid == 1, stride_bl1, stride_bl2)).to(tl.int64)
        tok = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M] token ids, T on padding
        valid = tok < num_tokens
        tok = tok.to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
        r_mask = offs_r < rank
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns within the slice
        n_mask = offs_n < size
        yt = tl.load(
            y_ptr + tok[:, None] * stride_yt + (sid * rank + offs_r)[None, :] * stride_yc,
            mask=valid[:, None] & r_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_R]
        bt = tl.load(
            b_ptr + slot * stride_bl + offs_n[None, :] * stride_bo + offs_r[:, None] * stride_br,
            mask=r_mask[:, None] & n_mask[None, :],
            other=0.0,
        )  # [BLOCK_R, BLOCK_N] = B[slot, n, r]^T
        if UPCAST:
            acc = tl.dot(yt.to(bt.dtype).to(tl.float32), bt.to(tl.float32), input_precision="ieee")
        elif FP32_DOT:
            acc = tl.dot(yt.to(tl.float32), bt, input_precision="ieee")
        else:
            acc = tl.dot(yt.to(bt.dtype), bt)  # [BLOCK_M, BLOCK_N] float32
        o_ptrs = out_ptr + tok[:, None] * stride_ot + (col0 + offs_n)[None, :] * stride_oc
        o_mask = valid[:, None] & n_mask[None, :]
        cur = tl.load(o_ptrs, mask=o_mask, other=0.0)
        tl.store(o_ptrs, (cur.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=o_mask)


class LoRATokenBlocks(NamedTuple):
    """The step's tokens by slot in BLOCK_M-row blocks (see the module docstring); shared by every layer's calls."""

    rows: torch.Tensor  # [P] int32 token ids, num_tokens on padding
    block_slot: torch.Tensor  # [P / block_m] int32 slot of each block, num_slots past the used blocks
    block_m: int
    num_slots: int


def lora_token_blocks(token_slots: torch.Tensor, num_slots: int, block_m: int) -> LoRATokenBlocks:
    """`token_slots [T]` (-1 = base; values outside [0, num_slots) are treated as base) -> the block layout, with
    device ops only (no host sync: CUDA-graph safe)."""
    device = token_slots.device
    t = token_slots.numel()
    num_rows = triton.cdiv(t + min(t, num_slots) * (block_m - 1), block_m) * block_m
    slots = token_slots.reshape(-1).long()  # [T]
    key = torch.where((slots >= 0) & (slots < num_slots), slots, num_slots)  # [T]; num_slots: base
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))  # [L+1] tokens per slot (last: base)
    padded = (counts[:num_slots] + block_m - 1) // block_m * block_m  # [L]
    ends = torch.cumsum(padded, 0)  # [L] end of each slot's padded run
    starts = torch.cat([ends - padded, ends.new_full((1,), num_rows)])  # [L+1]; base tokens go to the dump row
    order = torch.argsort(key, stable=True)  # [T] token ids by slot, then position
    sorted_key = key[order]  # [T]
    first = torch.cumsum(counts, 0) - counts  # [L+1] where each slot's run starts in `order`
    rank_in_slot = torch.arange(t, device=device) - first[sorted_key]  # [T]
    dest = torch.where(sorted_key < num_slots, starts[sorted_key] + rank_in_slot, num_rows)  # [T]
    rows = torch.full((num_rows + 1,), t, dtype=torch.int32, device=device)  # [P + 1]
    rows[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, num_rows, block_m, device=device)  # [P / block_m]
    block_slot = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    return LoRATokenBlocks(rows[:num_rows], block_slot, block_m, num_slots)


def lora_config(num_tokens: int, interpreted: bool = False) -> dict:
    """Launch meta-parameters (BLOCK_M shared by both kernels, BLOCK_K / SPLIT_K for the shrink, BLOCK_N for the
    expand, num_warps, num_stages) by the step's token count; a function of T only, so one per captured graph."""
    if interpreted:
        return dict(BLOCK_M=16, BLOCK_K=32, BLOCK_N=32, SPLIT_K=1, num_warps=4, num_stages=1)
    if num_tokens <= 64:  # decode: few blocks, so split the shrink's I over programs
        return dict(BLOCK_M=16, BLOCK_K=128, BLOCK_N=64, SPLIT_K=8, num_warps=4, num_stages=3)
    if num_tokens <= 512:
        return dict(BLOCK_M=32, BLOCK_K=64, BLOCK_N=64, SPLIT_K=4, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_K=64, BLOCK_N=128, SPLIT_K=1, num_warps=4, num_stages=3)


def _as_slices(weights) -> list[torch.Tensor]:
    # a [L, R, I] / [L, O, R] tensor, a list of them, or a stacked [S, L, ...] tensor -> list of 3-d slices
    if isinstance(weights, torch.Tensor):
        return [weights] if weights.dim() == 3 else list(weights.unbind(0))
    return list(weights)


def _launch_groups(slices: list[torch.Tensor], key) -> list[list[int]]:
    # consecutive slices sharing key(w), at most MAX_SLICES a group: one launch each
    groups: list[list[int]] = []
    for i, w in enumerate(slices):
        if groups and len(groups[-1]) < MAX_SLICES and key(slices[groups[-1][0]]) == key(w):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _prepare(token_slots, num_slots, num_tokens, device, blocks, config):
    cfg = dict(config or lora_config(num_tokens, device.type != "cuda"))
    assert min(cfg["BLOCK_M"], cfg["BLOCK_K"], cfg["BLOCK_N"]) >= MIN_DOT, cfg
    if blocks is None:
        blocks = lora_token_blocks(token_slots, num_slots, cfg["BLOCK_M"])
    assert blocks.block_m == cfg["BLOCK_M"] and blocks.num_slots == num_slots, (blocks.block_m, cfg)
    assert token_slots.shape == (num_tokens,), (tuple(token_slots.shape), num_tokens)
    return blocks, cfg


def lora_shrink(
    x: torch.Tensor,
    lora_a_stack,
    token_slots: torch.Tensor,
    out: torch.Tensor,
    scale: float = 1.0,
    *,
    blocks: LoRATokenBlocks | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """`out [T, S*R]` (float32, overwritten) = per token and slice `scale * x[t] @ A_s[slot_t]^T`, zero rows for
    slot -1; `x [T, I]`, `lora_a_stack`: S tensors `[L, R, I]`. Returns out."""
    slices = _as_slices(lora_a_stack)
    num_tokens, in_features = x.shape
    num_slots, rank = slices[0].shape[0], slices[0].shape[1]
    assert all(a.shape == (num_slots, rank, in_features) and a.dtype == slices[0].dtype for a in slices)
    assert out.shape == (num_tokens, len(slices) * rank) and out.stride(1) == 1, (tuple(out.shape), len(slices))
    if num_tokens == 0:
        return out
    blocks, cfg = _prepare(token_slots, num_slots, num_tokens, x.device, blocks, config)
    split = cfg["SPLIT_K"]
    # partial sums per share of I, summed below in a fixed order (deterministic); base rows stay 0
    part = out if split == 1 else out.new_empty(split, num_tokens, out.shape[1])
    part.zero_()
    interpreted = x.device.type != "cuda"
    for group in _launch_groups(slices, lambda a: a.stride()):
        ptrs = [slices[i] for i in group] + [slices[group[0]]] * (MAX_SLICES - len(group))
        a0 = slices[group[0]]
        y = part[..., group[0] * rank :]  # the group's first slice column onwards
        grid = (blocks.block_slot.shape[0], len(group), split)
        _shrink_kernel[grid](
            x,
            y,
            blocks.rows,
            blocks.block_slot,
            *ptrs,
            num_tokens,
            num_slots,
            rank,
            in_features,
            float(scale),
            x.stride(0),
            x.stride(1),
            y.stride(0) if split > 1 else 0,
            y.stride(-2),
            a0.stride(0),
            a0.stride(1),
            a0.stride(2),
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_R=max(MIN_DOT, triton.next_power_of_2(rank)),
            BLOCK_K=cfg["BLOCK_K"],
            SPLIT_K=split,
            UPCAST=interpreted and a0.dtype != torch.float32,
            FP32_DOT=a0.dtype == torch.float32,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
    if split > 1:
        torch.sum(part, dim=0, out=out)
    return out


def lora_expand(
    y: torch.Tensor,
    lora_b_stack,
    token_slots: torch.Tensor,
    out: torch.Tensor,
    offsets: list[int],
    *,
    blocks: LoRATokenBlocks | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """`out[t, off_s:off_s + O_s] += y[t, s*R:(s+1)*R] @ B_s[slot_t]^T` in place (float32 sums, one rounding to
    out.dtype), rows of slot -1 untouched; `y [T, S*R]`, `lora_b_stack`: S tensors `[L, O_s, R]`, `out [T, O]`.
    Returns out."""
    slices = _as_slices(lora_b_stack)
    num_tokens = y.shape[0]
    num_slots, _, rank = slices[0].shape
    assert len(offsets) == len(slices) and y.shape == (num_tokens, len(slices) * rank)
    assert all(b.shape[0] == num_slots and b.shape[2] == rank and b.dtype == slices[0].dtype for b in slices)
    assert out.shape[0] == num_tokens and all(
        0 <= o and o + b.shape[1] <= out.shape[1] for o, b in zip(offsets, slices)
    ), (tuple(out.shape), offsets)
    if num_tokens == 0:
        return out
    blocks, cfg = _prepare(token_slots, num_slots, num_tokens, y.device, blocks, config)
    interpreted = y.device.type != "cuda"
    for group in _launch_groups(slices, lambda b: b.stride()[1:]):
        pick = group + [group[0]] * (MAX_SLICES - len(group))
        b0 = slices[group[0]]
        yg = y[:, group[0] * rank :]  # the group's first slice column onwards
        width = max(slices[i].shape[1] for i in group)
        grid = (triton.cdiv(width, cfg["BLOCK_N"]), blocks.block_slot.shape[0], len(group))
        _expand_kernel[grid](
            yg,
            out,
            blocks.rows,
            blocks.block_slot,
            *(slices[i] for i in pick),
            num_tokens,
            num_slots,
            rank,
            *(slices[i].shape[1] for i in pick),
            *(offsets[i] for i in pick),
            *(slices[i].stride(0) for i in pick),
            yg.stride(0),
            yg.stride(1),
            out.stride(0),
            out.stride(1),
            b0.stride(1),
            b0.stride(2),
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_R=max(MIN_DOT, triton.next_power_of_2(rank)),
            BLOCK_N=cfg["BLOCK_N"],
            UPCAST=interpreted and b0.dtype != torch.float32,
            FP32_DOT=b0.dtype == torch.float32,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
    return out


def add_lora_triton(
    x: torch.Tensor,
    out: torch.Tensor,
    lora_a,
    lora_b,
    offsets: list[int],
    token_slots: torch.Tensor,
    *,
    blocks: LoRATokenBlocks | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """`lora_ref.add_lora_grouped` per token: `out[t, off_s:...] += x[t] @ A_s[slot_t]^T @ B_s[slot_t]^T` for
    every slice s and every token with slot_t >= 0 (others untouched); `x [T, I]`, `out [T, O]`, `lora_a[s]
    [L, R, I]`, `lora_b[s] [L, O_s, R]`. Shrink into a float32 `[T, S*R]`, then expand. Returns out."""
    a_slices, b_slices = _as_slices(lora_a), _as_slices(lora_b)
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return out
    cfg = dict(config or lora_config(num_tokens, x.device.type != "cuda"))
    if blocks is None:
        blocks = lora_token_blocks(token_slots, a_slices[0].shape[0], cfg["BLOCK_M"])
    y = torch.empty(num_tokens, len(a_slices) * a_slices[0].shape[1], dtype=torch.float32, device=x.device)
    lora_shrink(x, a_slices, token_slots, y, blocks=blocks, config=cfg)  # [T, S*R]
    return lora_expand(y, b_slices, token_slots, out, offsets, blocks=blocks, config=cfg)


__all__ = ["LoRATokenBlocks", "add_lora_triton", "lora_config", "lora_expand", "lora_shrink", "lora_token_blocks"]
