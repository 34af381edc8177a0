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


def group_by_expert(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, expert_offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
    """The (token, choice) pairs routed to experts [expert_offset, +num_experts), sorted by expert then token:
    (`tokens [S]`, `weights [S]`, rows per local expert), or None when there are none."""
    top_k = topk_ids.shape[1]
    local = topk_ids.reshape(-1) - expert_offset  # [T*k]
    slots = torch.nonzero((local >= 0) & (local < num_experts)).squeeze(1)  # [S] flattened (token, choice) pairs
    if slots.numel() == 0:
        return None
    experts = local[slots]
    order = torch.argsort(experts, stable=True)  # by expert, then token order
    slots, experts = slots[order], experts[order]
    counts = torch.bincount(experts, minlength=num_experts).tolist()
    return slots // top_k, topk_weights.reshape(-1)[slots], counts


def _run_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    expert_offset: int,
    expert_ffn,
) -> torch.Tensor:
    """`expert_ffn(e, rows [n, H]) -> [n, H]` over each local expert's rows, weighted and summed per token."""
    out = torch.zeros_like(x)  # [T, H]
    grouped = group_by_expert(topk_weights, topk_ids, num_experts, expert_offset) if x.shape[0] else None
    if grouped is None:
        return out
    tokens, weights, counts = grouped
    rows = x.index_select(0, tokens)  # [S, H], grouped by expert
    outputs = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n:
            outputs[start : start + n] = expert_ffn(e, rows[start : start + n]) * weights[start : start + n, None]
            start += n
    out.index_add_(0, tokens, outputs)  # ascending expert order per token, as HF accumulates
    return out


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation_name: str = "silu",
    expert_offset: int = 0,
) -> torch.Tensor:
    """`x [T, H]`, `w13 [E, 2I, H]` (gate rows then up rows), `w2 [E, H, I]`, `topk_weights / topk_ids [T, k]`
    -> `[T, H]`. Expert ids are global; this rank holds experts [expert_offset, expert_offset + E) and ids
    outside that range contribute nothing (expert parallelism sums the ranks' outputs)."""
    inter = w13.shape[1] // 2
    act = activation(activation_name)

    def ffn(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(rows, w13[e])  # [n, 2I]
        return F.linear(act(gate_up[:, :inter]) * gate_up[:, inter:], w2[e])  # [n, H]

    return _run_experts(x, topk_weights, topk_ids, w13.shape[0], expert_offset, ffn)


def fused_moe_packed_cpu(
    x: torch.Tensor,
    packed_w13: torch.Tensor,
    packed_w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    intermediate_size: int,
    expert_offset: int = 0,
) -> torch.Tensor:
    """`fused_moe_ref` with SiLU on the packed CPU linear kernel: each expert's `w13` / `w2` packed
    (kernels.cpu_linear.pack_linear_weight, stacked `[E, ...]`), silu(gate) * up fused into the first matmul's
    pass. Under torch.compile it is one opaque op (`vlserve::fused_moe_packed_cpu`): grouping tokens by expert
    sizes tensors by the routing, which a compiled graph cannot guard on."""
    run = torch.ops.vlserve.fused_moe_packed_cpu if torch.compiler.is_compiling() else _fused_moe_packed_cpu
    return run(x, packed_w13, packed_w2, topk_weights, topk_ids, intermediate_size, expert_offset)


def _fused_moe_packed_cpu(
    x: torch.Tensor,
    packed_w13: torch.Tensor,
    packed_w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    intermediate_size: int,
    expert_offset: int,
) -> torch.Tensor:
    from vlserve.kernels.cpu_linear import cpu_linear, cpu_linear_silu_mul

    hidden = x.shape[1]

    def ffn(e: int, rows: torch.Tensor) -> torch.Tensor:
        return cpu_linear(cpu_linear_silu_mul(rows, packed_w13[e], None, intermediate_size), packed_w2[e], None, hidden)

    return _run_experts(x, topk_weights, topk_ids, len(packed_w13), expert_offset, ffn)


_LIB = torch.library.Library("vlserve", "FRAGMENT")
_LIB.define(
    "fused_moe_packed_cpu(Tensor x, Tensor packed_w13, Tensor packed_w2, Tensor topk_weights, "
    "Tensor topk_ids, int intermediate_size, int expert_offset) -> Tensor"
)
_LIB.impl("fused_moe_packed_cpu", _fused_moe_packed_cpu, "CPU")


@torch.library.register_fake("vlserve::fused_moe_packed_cpu")
def _fused_moe_packed_cpu_fake(x, packed_w13, packed_w2, topk_weights, topk_ids, intermediate_size, expert_offset):
    return torch.empty_like(x)  # [T, H]
