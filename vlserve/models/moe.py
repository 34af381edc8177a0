"""Sparse mixture-of-experts FFN blocks (Qwen3-VL-MoE): a replicated router and the experts' stacked weights, run by
`kernels.fused_moe` (a Triton grouped GEMM on GPU, its torch twin on CPU).

Under tensor parallelism the experts are split by index over the ranks (expert parallelism): rank r holds experts
[r * E / tp, (r + 1) * E / tp), computes those experts' share for every token, and the ranks' outputs are summed
(the all-reduce a row-parallel layer does). Weights load from both transformers layouts of the stacked tensors:
5.x keeps `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]` (ours), 4.57 and the released checkpoints
`[E, H, 2I]` / `[E, I, H]`, transposed on load.

T = tokens, H = hidden size, E = experts, I = expert MLP width, k = experts per token.
"""

from __future__ import annotations

import torch
from torch import nn

from vlserve import kernels
from vlserve.distributed.communication import tp_all_reduce
from vlserve.distributed.parallel_state import tp_rank, tp_size
from vlserve.kernels.cpu_linear import PANEL, cpu_linear_supported, pack_linear_weight
from vlserve.kernels.fused_moe_ref import fused_moe_packed_cpu, route_topk
from vlserve.kernels.packed_linear import PackableLinear
from vlserve.models.parallel_layers import ShardSpec, copy_weight


class FusedExperts(nn.Module):
    """This rank's experts: `gate_up_proj [E/tp, 2I, H]` (gate rows, then up rows) and `down_proj [E/tp, H, I]`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str = "silu") -> None:
        super().__init__()
        tp = tp_size()
        if num_experts % tp:
            raise ValueError(
                f"num_experts ({num_experts}) must be divisible by tensor_parallel_size ({tp}): the "
                f"experts are split over the ranks"
            )
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.num_local = num_experts // tp
        self.expert_offset = tp_rank() * self.num_local
        self.hidden_act = hidden_act
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.num_local, hidden_size, intermediate_size))
        self.register_parameter("packed_gate_up", None)  # set by pack_for_cpu
        self.register_parameter("packed_down", None)

    def checkpoint_shard(self, param: str, piece: str | None = None) -> ShardSpec | None:
        """This rank's experts: a slice of dim 0 (the expert axis in both layouts)."""
        return None if tp_size() == 1 else (0, self.expert_offset, self.num_local)

    def load_shard(self, param: str, piece: str | None, tensor: torch.Tensor, name: str) -> None:
        """Copy this rank's experts of `gate_up_proj` / `down_proj`, transposing the released layout. A square
        matrix (I == H for down_proj) cannot tell the layouts apart: it is read as released, the layout of every
        published checkpoint."""
        dst = getattr(self, param)
        theirs = (dst.shape[0], dst.shape[2], dst.shape[1])
        if tuple(tensor.shape) == theirs:
            tensor = tensor.transpose(1, 2)  # [E, H, 2I] -> [E, 2I, H]; [E, I, H] -> [E, H, I]
        copy_weight(dst, tensor, name)

    def pack_for_cpu(self, keep_weight: bool = False) -> bool:
        """Pack every expert's two matrices for the CPU linear kernel (SiLU experts whose widths fill its 32-wide
        panels, as GatedMLP's fused path needs); the stacked weights are then dropped. Whether it packed."""
        if self.packed_gate_up is not None or self.gate_up_proj is None:
            return False
        fits = self.hidden_act in ("silu", "swish") and self.intermediate_size % PANEL == 0
        if not fits or not cpu_linear_supported(self.gate_up_proj[0].data):
            return False
        self.packed_gate_up = nn.Parameter(
            torch.stack([pack_linear_weight(w) for w in self.gate_up_proj.data]), requires_grad=False
        )  # [E/tp, 2I/32, H, 32] (float32 panels)
        self.packed_down = nn.Parameter(
            torch.stack([pack_linear_weight(w) for w in self.down_proj.data]), requires_grad=False
        )  # [E/tp, H/32, I, 32]
        if not keep_weight:
            self.gate_up_proj = self.down_proj = None  # held once
        return True

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """`x [T, H]`, the routing `[T, k]` -> `[T, H]` summed over the ranks."""
        if self.packed_gate_up is not None:
            out = fused_moe_packed_cpu(
                x.to(self.packed_gate_up.dtype),
                self.packed_gate_up,
                self.packed_down,
                topk_weights,
                topk_ids,
                self.intermediate_size,
                self.expert_offset,
            )
        else:
            out = kernels.fused_moe(
                x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, self.hidden_act, self.expert_offset
            )
        return tp_all_reduce(out) if tp_size() > 1 else out


class SparseMoeBlock(nn.Module):
    """`gate` (the router, `[E, H]`, replicated) picks k experts per token by softmax (renormalized over the k);
    `experts` run them. Weight names as HF's: `mlp.gate.weight`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`."""

    def __init__(self, config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = bool(getattr(config, "norm_topk_prob", True))
        self.gate = PackableLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedExperts(
            config.num_experts, config.hidden_size, config.moe_intermediate_size, getattr(config, "hidden_act", "silu")
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> router logits [T, E] -> (weights, ids) [T, k] -> [T, H]
        weights, ids = route_topk(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, weights, ids)


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Whether decoder layer `layer_idx` has a sparse MoE block (else a dense MLP), by Qwen3-MoE's rule:
    not in `mlp_only_layers`, and every `decoder_sparse_step`-th layer."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        getattr(config, "num_experts", 0) > 0
        and layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and (layer_idx + 1) % step == 0
    )
