"""Triton mixture-of-experts FFN (the vLLM design, our own code): align, two grouped GEMMs, a per-token sum.

`fused_moe_triton` computes what `fused_moe_ref` does, in four steps:
1. `moe_align_block_size` (torch ops on the device, no host sync, so CUDA-graph safe): the S = T*k (token, choice)
   pairs routed to this rank's experts, sorted by expert, each expert's run padded to a multiple of BLOCK_M.
   `sorted_ids [S_max]` holds pair ids p = t*k + j (the sentinel S on padding), `block_expert [S_max / BLOCK_M]`
   the local expert of each M-block and `num_valid [1]` the padded rows in use; S_max = S + min(S, E) * (BLOCK_M - 1)
   (rounded up to BLOCK_M) bounds `num_valid` for any routing, so every buffer has a shape known on the host.
2. `_moe_gemm_kernel` with GATHER_A: a program takes one M-block (one expert) and one N-block, gathers its x rows
   (x[p // k], padding masked to zero), multiplies by that expert's w13 tile in float32 and writes
   `gate_up [S_max, 2I]` at the block's positions; blocks past `num_valid` exit at once. Then act(gate) * up in torch.
3. The same kernel again over `hidden [S_max, I]` and w2, scaling each row by its routing weight
   (MUL_ROUTED_WEIGHT) and scattering it to row p of a float32 `y [S, H]` (zero for pairs not on this rank).
4. `y.view(T, k, H).sum(1)` in x's dtype (a fixed order: no atomics, deterministic).

Where this has run: Triton's CPU interpreter (tests/kernels/test_fused_moe.py) and, as a slow test there, the sm_90
ahead-of-time compile (lowered to a cubin, never launched). It has not executed on a GPU; the GPU tiles of
`moe_config` are untuned guesses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlserve.kernels.activation import activation

MIN_DOT = 16  # tl.dot needs every dimension >= 16


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_valid_ptr,
    weights_ptr,
    N,
    K,
    num_pairs,
    top_k,
    num_blocks,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    GATHER_A: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    UPCAST: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # GATHER_A: a = x [T, K], A row of position r is x[sorted_ids[r] // top_k], out [S_max, N] at position r.
    # else:     a = hidden [S_max, K] at position r, out [num_pairs, N] at row sorted_ids[r] (padding not stored).
    # w [E, N, K]; grid: num_blocks * cdiv(N, BLOCK_N), GROUP_M M-blocks share each N-block (L2 reuse of w).
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    m0 = pid_m * BLOCK_M
    if m0 < tl.load(num_valid_ptr):
        pos = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] padded positions
        ids = tl.load(sorted_ids_ptr + pos)  # [BLOCK_M] pair ids; num_pairs on padding
        valid = ids < num_pairs
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        n_mask = offs_n < N
        if GATHER_A:
            a_rows = (ids // top_k).to(tl.int64)
        else:
            a_rows = pos.to(tl.int64)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am  # [BLOCK_M, 1]
        w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            k_mask = offs_k < K
            a = tl.load(a_ptrs + offs_k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
            w = tl.load(
                w_ptrs + offs_k[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0
            )  # [BLOCK_K, BLOCK_N]
            if UPCAST:
                # the interpreter's bf16 dot is wrong: multiply the bf16 values in float32 instead
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            elif FP32_DOT:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        if MUL_ROUTED_WEIGHT:
            rw = tl.load(weights_ptr + ids, mask=valid, other=0.0).to(tl.float32)  # [BLOCK_M]
            acc = acc * rw[:, None]
        if GATHER_A:
            out_rows = pos.to(tl.int64)
            out_mask = (pos >= 0)[:, None] & n_mask[None, :]  # padding rows too (zeros): hidden has no garbage
        else:
            out_rows = ids.to(tl.int64)
            out_mask = valid[:, None] & n_mask[None, :]
        tl.store(
            out_ptr + out_rows[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask
        )


def moe_config(num_pairs: int, num_experts: int, interpreted: bool = False) -> dict:
    """Launch meta-parameters (BLOCK_M/N/K, GROUP_M, num_warps, num_stages) by the mean rows per expert."""
    if interpreted:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1)
    per_expert = num_pairs / max(1, num_experts)
    if per_expert <= 16:  # decode: stream the weights, few rows a block
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`topk_ids [T, k]` (global ids) -> (`sorted_ids [S_max]` int32 pair ids, sentinel T*k on padding;
    `block_expert [S_max / block_m]` int32 local expert per M-block, `num_experts` past the used rows;
    `num_valid [1]` int32 padded rows in use). Pairs outside [expert_offset, +num_experts) are left out."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    max_rows = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    max_rows = triton.cdiv(max_rows, block_m) * block_m
    local = topk_ids.reshape(-1).long() - expert_offset  # [S]
    expert = torch.where((local >= 0) & (local < num_experts), local, num_experts)  # [S]; E: not on this rank
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))  # [E+1]
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m  # [E]
    ends = torch.cumsum(padded, 0)  # [E] end of each expert's padded run
    starts = torch.cat([ends - padded, ends.new_full((1,), max_rows)])  # [E+1]; non-local pairs go to the dump row
    order = torch.argsort(expert, stable=True)  # [S] pair ids by expert, then pair order
    sorted_expert = expert[order]  # [S]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_expert]  # [S]
    dest = torch.where(sorted_expert < num_experts, starts[sorted_expert] + rank, max_rows)  # [S]
    sorted_ids = torch.full((max_rows + 1,), num_pairs, dtype=torch.int32, device=device)  # [S_max + 1]
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, max_rows, block_m, device=device)  # [S_max / block_m]
    block_expert = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    num_valid = ends[-1:].to(torch.int32)  # [1]
    return sorted_ids[:max_rows], block_expert, num_valid


def _grouped_gemm(a, w, out, sorted_ids, block_expert, num_valid, weights, num_pairs, top_k, gather_a, cfg):
    # a [rows, K] (K contiguous); w [E, N, K]; out [rows', N] (N contiguous)
    n, k = w.shape[1], w.shape[2]
    num_blocks = block_expert.shape[0]
    interpreted = a.device.type != "cuda"
    grid = (num_blocks * triton.cdiv(n, cfg["BLOCK_N"]),)
    _moe_gemm_kernel[grid](
        a,
        w,
        out,
        sorted_ids,
        block_expert,
        num_valid,
        weights,
        n,
        k,
        num_pairs,
        top_k,
        num_blocks,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        GATHER_A=gather_a,
        MUL_ROUTED_WEIGHT=not gather_a,
        UPCAST=interpreted and a.dtype == torch.bfloat16,
        FP32_DOT=a.dtype == torch.float32,
        **cfg,
    )


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation_name: str = "silu",
    expert_offset: int = 0,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """`fused_moe_ref`'s contract on Triton grouped GEMMs: `x [T, H]`, `w13 [E, 2I, H]`, `w2 [E, H, I]`,
    `topk_weights / topk_ids [T, k]` -> `[T, H]` in x.dtype (experts [expert_offset, +E) only). `config` fixes
    the launch (`moe_config`'s keys)."""
    num_tokens, hidden_size = x.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32) and w13.dtype == w2.dtype == x.dtype
    assert w13.shape == (num_experts, 2 * inter, hidden_size) and w2.shape == (num_experts, hidden_size, inter)
    act = activation(activation_name)  # ValueError for an unknown name, before any launch
    num_pairs = num_tokens * top_k
    if num_pairs == 0 or num_experts == 0:
        return torch.zeros_like(x)
    cfg = dict(config or moe_config(num_pairs, num_experts, x.device.type != "cuda"))
    assert min(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) >= MIN_DOT
    x = x.contiguous()
    weights = topk_weights.reshape(-1).contiguous()  # [S]
    sorted_ids, block_expert, num_valid = moe_align_block_size(topk_ids, num_experts, cfg["BLOCK_M"], expert_offset)
    max_rows = sorted_ids.shape[0]
    gate_up = x.new_empty(max_rows, 2 * inter)  # [S_max, 2I]; rows past num_valid stay unwritten (never read)
    _grouped_gemm(x, w13, gate_up, sorted_ids, block_expert, num_valid, weights, num_pairs, top_k, True, cfg)
    hidden = act(gate_up[:, :inter]) * gate_up[:, inter:]  # [S_max, I]
    y = torch.zeros(num_pairs, hidden_size, dtype=torch.float32, device=x.device)  # [S, H]; 0 for other ranks
    _grouped_gemm(hidden, w2, y, sorted_ids, block_expert, num_valid, weights, num_pairs, 1, False, cfg)
    return y.view(num_tokens, top_k, hidden_size).sum(dim=1).to(x.dtype)  # [T, H]


__all__ = ["fused_moe_triton", "moe_align_block_size", "moe_config"]
