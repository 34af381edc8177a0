"""Mixture-of-experts FFN in plain torch: top-k routing and a grouped GEMM over the experts a step's tokens chose.

`fused_moe(x, w13, w2, topk_weights, topk_ids)`: every token's k chosen experts each compute
`w2[e] @ (act(gate) * up)` with `[gate; up] = w13[e] @ x`, scaled by the token's routing weight, summed per token
in ascending expert order (HF's order, so float32 results match it). Rows are sorted by expert once; each expert
with tokens runs two matmuls over its contiguous rows (no per-token loop, no one-hot masks).

Shapes: T tokens, H hidden, E experts (this rank's), I expert MLP width, k experts per token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vlserve.kernels.activation import activation


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`router_logits [T, E]` -> (`weights [T, k]` in the logits' dtype, `ids [T, k]` int64): softmax in float32,
    the k largest, renormalized to sum 1 when asked (Qwen3-MoE's rule)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation_name: str = "silu", expert_offset: int = 0) -> torch.Tensor:
    """`x [T, H]`, `w13 [E, 2I, H]` (gate rows then up rows), `w2 [E, H, I]`, `topk_weights / topk_ids [T, k]`
    -> `[T, H]`. Expert ids are global; this rank holds experts [expert_offset, expert_offset + E) and ids
    outside that range contribute nothing (expert parallelism sums the ranks' outputs)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    out = torch.zeros_like(x)  # [T, H]
    if num_tokens == 0:
        return out
    local = topk_ids.reshape(-1) - expert_offset  # [T*k]
    mine = (local >= 0) & (local < num_experts)
    slots = torch.nonzero(mine).squeeze(1)  # [S] indexes into the flattened (token, choice) pairs
    if slots.numel() == 0:
        return out
    experts = local[slots]
    order = torch.argsort(experts, stable=True)  # by expert, then token order
    slots, experts = slots[order], experts[order]
    tokens = slots // top_k  # [S]
    weights = topk_weights.reshape(-1)[slots]  # [S]
    counts = torch.bincount(experts, minlength=num_experts).tolist()
    act = activation(activation_name)
    rows = x.index_select(0, tokens)  # [S, H], grouped by expert
    outputs = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        gate_up = F.linear(rows[start:start + n], w13[e])  # [n, 2I]
        hidden = act(gate_up[:, :inter]) * gate_up[:, inter:]  # [n, I]
        outputs[start:start + n] = F.linear(hidden, w2[e]) * weights[start:start + n, None]
        start += n
    out.index_add_(0, tokens, outputs)  # ascending expert order per token, as HF accumulates
    return out
