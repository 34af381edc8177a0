"""Paged attention as one opaque `torch.ops.vlserve.paged_attention` op, for compiled (and CUDA-graphed) forwards.

Dynamo must not trace into the attention kernels: the torch path loops over sequences in Python and reads
`AttentionMetadata`'s host lists, and the Triton path launches kernels whose grids come from those lists; traced,
each step's lengths would become guards and recompile the graph. So the compiled model calls this custom op with
tensors and constants only: the layer's query/key/value, its layer index, scale, KV scales (k_scale / v_scale,
used by FP8 caches only) and sliding window (None: full attention). The step's metadata and the
KV caches come from a step context the forward wrapper sets around the call (`attention_step`), as vLLM's forward
context does. The op writes the layer's K/V into its cache (a side effect the graph does not see: no other op in
the graph reads the caches) and returns a fresh `[T, Hq, D]` tensor; its fake implementation only gives the shape.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from vlserve import kernels
from vlserve.kernels.metadata import AttentionMetadata


@dataclass
class AttentionStep:
    """What every layer's attention op reads during one forward: the metadata and the per-layer (K, V) caches."""

    metadata: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]


_current: list[AttentionStep] = []  # a stack: one entry while a compiled forward runs


@contextlib.contextmanager
def attention_step(metadata: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
    """Make `metadata` and `kv_caches` what `paged_attention` reads for the duration of the block."""
    _current.append(AttentionStep(metadata, kv_caches))
    try:
        yield
    finally:
        _current.pop()


def current_attention_step() -> AttentionStep:
    """The innermost active step; RuntimeError outside `attention_step`."""
    if not _current:
        raise RuntimeError("torch.ops.vlserve.paged_attention called outside attention_step(...)")
    return _current[-1]


# Defined through torch.library.Library (one implementation for every device) rather than the custom_op decorator,
# whose wrappers cost ~15 us more a call, eight or more calls a step.
_LIB = torch.library.Library("vlserve", "FRAGMENT")
_LIB.define(
    "paged_attention(Tensor query, Tensor key, Tensor value, int layer_idx, float scale, "
    "float k_scale=1.0, float v_scale=1.0, int? sliding_window=None) -> Tensor"
)


def _paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Write key/value [T, Hkv, D] into layer `layer_idx`'s cache and attend: query [T, Hq, D] -> [T, Hq, D]
    (`sliding_window` W: each query sees its last W positions)."""
    step = current_attention_step()
    k_cache, v_cache = step.kv_caches[layer_idx]
    # an op's output may not alias its inputs; attention_forward always returns a new tensor
    return kernels.attention_forward(
        query,
        key,
        value,
        k_cache,
        v_cache,
        step.metadata.for_layer(layer_idx),
        scale,
        k_scale=k_scale,
        v_scale=v_scale,
        sliding_window=sliding_window,
    )


_LIB.impl("paged_attention", _paged_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("vlserve::paged_attention")
def _paged_attention_fake(query, key, value, layer_idx, scale, k_scale=1.0, v_scale=1.0, sliding_window=None):
    return torch.empty_like(query)


# the op: (query, key, value, layer_idx, scale, k_scale=1.0, v_scale=1.0, sliding_window=None) -> [T, Hq, D]
paged_attention = torch.ops.vlserve.paged_attention
