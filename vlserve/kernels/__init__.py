"""Attention (paged causal; bidirectional varlen for vision towers), KV-cache and rotary kernels with a torch path
(CPU) and a Triton path (CUDA).

The exported names dispatch per call on the device of their tensor arguments (cuda -> triton,
otherwise torch); `VLSERVE_ATTENTION_BACKEND=torch|triton` forces one. Triton modules are
imported lazily, only when the triton backend is used (on CPU that needs TRITON_INTERPRET=1); on
CUDA that variable would make them interpreter kernels, so the first CUDA call warns if it is set.

The KV caches are in the model's dtype or float8_e4m3fn (`kv_quant`); with an FP8 cache the writers and the paged
attention take the layer's `k_scale` / `v_scale` (keyword arguments, 1.0 by default; other caches ignore them).

The paged attentions take an optional `sliding_window` W (None: full causal attention): the query at position p
then attends only to keys at positions p - W + 1 .. p (HF's `sliding_window_causal_mask_function`).

`attention_forward` also honours `md.key_limits` (per-query highest key position, Gemma 3's bidirectional image
tokens; see `key_limits`): the torch path masks those prefill sequences per row; on the GPU (Triton backend) a step
with such tokens runs its prefill sequences through that torch path as a fallback, its decodes stay on Triton.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from collections.abc import Callable

import torch

from vlserve.kernels.attention_ref import (
    attention_forward_ref,
    decode_workspace_numel,
    paged_attention_decode_ref,
    paged_prefill_attention_ref,
)
from vlserve.kernels.fused_moe_ref import fused_moe_ref
from vlserve.kernels.kv_write_ref import write_kv_cache_ref
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.kernels.rotary_cpu import apply_rotary_cpu
from vlserve.kernels.rotary_ref import apply_rotary_float32_ref, apply_rotary_ref, build_rotary_cache
from vlserve.kernels.varlen_attention_ref import varlen_attention_ref

BACKEND_ENV = "VLSERVE_ATTENTION_BACKEND"
_BACKENDS = ("torch", "triton")

_REF_IMPLS: dict[str, Callable] = {
    "write_kv_cache": write_kv_cache_ref,
    "paged_attention_decode": paged_attention_decode_ref,
    "paged_prefill_attention": paged_prefill_attention_ref,
    "attention_forward": attention_forward_ref,
    "apply_rotary": apply_rotary_cpu,  # C++ on CPU tensors where it applies, else apply_rotary_ref
    "varlen_attention": varlen_attention_ref,
    "fused_moe": fused_moe_ref,
}
_TRITON_IMPLS: dict[str, tuple[str, str]] = {
    "write_kv_cache": ("vlserve.kernels.triton_kv_write", "write_kv_cache_triton"),
    "paged_attention_decode": ("vlserve.kernels.triton_attention", "paged_attention_decode_triton"),
    "paged_prefill_attention": ("vlserve.kernels.triton_prefill", "paged_prefill_attention_triton"),
    "attention_forward": ("vlserve.kernels.triton_attention", "attention_forward_triton"),
    "apply_rotary": ("vlserve.kernels.triton_rotary", "apply_rotary_triton"),
    "varlen_attention": ("vlserve.kernels.triton_varlen_attention", "varlen_attention_triton"),
    "fused_moe": ("vlserve.kernels.triton_fused_moe", "fused_moe_triton"),
}


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def get_attention_backend(device: torch.device | str | None = None) -> str:
    """'torch' or 'triton': the env override if set, else triton for CUDA devices (no device: if CUDA exists)."""
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"{BACKEND_ENV}={forced!r}; expected one of {_BACKENDS}")
        return forced
    if device is None:
        is_cuda = torch.cuda.is_available()
    else:
        is_cuda = torch.device(device).type == "cuda"
    return "triton" if is_cuda and _triton_available() else "torch"


@functools.cache
def _triton_impl(name: str) -> Callable:
    module_name, attr = _TRITON_IMPLS[name]
    return getattr(importlib.import_module(module_name), attr)


def _interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _warn_if_interpreter_on_cuda() -> None:
    # checked once per process: the flag matters when the triton modules are imported, i.e. at first use
    if _interpreter_enabled():
        warnings.warn(
            "TRITON_INTERPRET is set while the Triton kernels run on CUDA tensors: they were built for the CPU "
            "interpreter instead of compiled for the GPU (very slow, host round trips); unset it",
            RuntimeWarning,
            stacklevel=3,
        )


def _impl(name: str, device: torch.device) -> Callable:
    if device.type != "cuda" and not os.environ.get(BACKEND_ENV):  # the common CPU case, once per layer and step
        return _REF_IMPLS[name]
    if get_attention_backend(device) == "torch":
        return _REF_IMPLS[name]
    if device.type == "cuda":
        _warn_if_interpreter_on_cuda()
    elif not _interpreter_enabled():
        raise RuntimeError(
            f"{BACKEND_ENV}=triton with {device.type} tensors needs TRITON_INTERPRET=1 set before triton is imported"
        )
    return _triton_impl(name)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter key/value [T, Hkv, D] into the paged caches at slot_mapping [T]; slot -1 is skipped (FP8 caches:
    `clamp(x / scale, +-448)` as float8_e4m3fn)."""
    _impl("write_kv_cache", key.device)(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Single-token decode attention: query [B, Hq, D] at position seq_len-1 over seq_len cached keys (the last
    `sliding_window` of them when given; `workspace`: the torch path's scratch buffer, see `decode_workspace_numel`;
    the Triton path ignores it)."""
    return _impl("paged_attention_decode", query.device)(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        max_seq_len=max_seq_len,
        out=out,
        workspace=workspace,
        k_scale=k_scale,
        v_scale=v_scale,
        sliding_window=sliding_window,
    )


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal varlen prefill: query [T, Hq, D] over each sequence's cached prefix plus its new tokens (within
    `sliding_window` when given)."""
    return _impl("paged_prefill_attention", query.device)(
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        max_query_len=max_query_len,
        out=out,
        k_scale=k_scale,
        v_scale=v_scale,
        sliding_window=sliding_window,
    )


def attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Write K/V through md.slot_mapping, then decode md.num_decodes sequences and prefill the rest -> [T, Hq, D]
    (FP8 caches: with the layer's k_scale / v_scale; `sliding_window` W: each query sees its last W positions)."""
    return _impl("attention_forward", query.device)(
        query, key, value, k_cache, v_cache, md, scale, k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window
    )


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    max_seqlen: int | None = None,
    cu_seqlens_cpu: list[int] | None = None,
    out: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Varlen attention over contiguous query/key/value [T, H, D]: each segment of cu_seqlens [B+1] attends only
    to itself (block-diagonal, as vision towers need; `causal`: each row to the rows before it too, as text towers
    need); no KV cache. The Triton kernel is bidirectional: causal calls take the torch path."""
    impl = varlen_attention_ref if causal else _impl("varlen_attention", query.device)
    kwargs = {"causal": True} if causal else {}
    return impl(
        query, key, value, cu_seqlens, scale, max_seqlen=max_seqlen, cu_seqlens_cpu=cu_seqlens_cpu, out=out, **kwargs
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation_name: str = "silu",
    expert_offset: int = 0,
) -> torch.Tensor:
    """Mixture-of-experts FFN over the chosen experts: `x [T, H]`, `w13 [E, 2I, H]`, `w2 [E, H, I]`,
    `topk_weights / topk_ids [T, k]` -> `[T, H]` (see kernels.fused_moe_ref; experts [expert_offset, +E) only)."""
    return _impl("fused_moe", x.device)(x, w13, w2, topk_weights, topk_ids, activation_name, expert_offset)


def apply_rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    mrope_section: list[int] | None = None,
) -> None:
    """In-place NeoX rotary on the first R dims of query/key; positions [T] or [3, T] (M-RoPE)."""
    _impl("apply_rotary", query.device)(query, key, positions, cos_cache, sin_cache, mrope_section)


def apply_rotary_float32(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    mrope_section: list[int] | None = None,
) -> None:
    """`apply_rotary` evaluated in float32 whatever query/key's dtype, the results rounded back once in place (HF's
    vision towers): one C++ pass on CPU, float32 copies elsewhere."""
    if query.device.type == "cpu":
        apply_rotary_cpu(query, key, positions, cos_cache, sin_cache, mrope_section, float32_math=True)
        return
    apply_rotary_float32_ref(query, key, positions, cos_cache, sin_cache, mrope_section, rotate=apply_rotary)


__all__ = [
    "decode_workspace_numel",
    "AttentionMetadata",
    "BACKEND_ENV",
    "apply_rotary",
    "apply_rotary_float32",
    "fused_moe",
    "apply_rotary_ref",
    "attention_forward",
    "attention_forward_ref",
    "build_rotary_cache",
    "get_attention_backend",
    "paged_attention_decode",
    "paged_attention_decode_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "varlen_attention",
    "varlen_attention_ref",
    "write_kv_cache",
    "write_kv_cache_ref",
]
