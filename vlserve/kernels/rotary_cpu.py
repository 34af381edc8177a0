"""Rotary embedding on CPU in C++ (csrc/rotary_cpu.cpp), in place on query and key, bit-identical to
`rotary_ref.apply_rotary_ref` (HF's op-by-op arithmetic in the tensors' dtype, no fused multiply-adds).

torch runs the reference as a table gather, two casts and six elementwise ops per tensor, each a pass over
memory; in a Qwen2-VL tower at 1024 patches that was 15 ms per image of the tower's ~117 (bf16, 2 cores). This is
one pass, each token's cos / sin row built once for all its heads. Taken where it applies (CPU, query and key of
one dtype, float32 or bf16, the last dim contiguous, a float32 or bf16 cache, a kernel built here; not switched
off by $VLSERVE_CPU_ROTARY_KERNEL=0); the reference runs otherwise.
"""

from __future__ import annotations

import functools
import os

import torch

from vlserve.kernels.cpp_build import load_cpu_kernel
from vlserve.kernels.rotary_ref import apply_rotary_float32_ref, apply_rotary_ref

DISABLE_ENV = "VLSERVE_CPU_ROTARY_KERNEL"
_DTYPES = (torch.float32, torch.bfloat16)
_DECLARATION = """
#include <cstdint>
extern "C" void kernel(void* q, int64_t q_tok, int64_t q_head, int64_t Hq, void* k, int64_t k_tok, int64_t k_head,
                       int64_t Hk, const int64_t* pos, int64_t axes, int64_t T, const void* cos_cache,
                       const void* sin_cache, int64_t cache_bf16, int64_t half, const int64_t* section,
                       int64_t is_bf16, int64_t float32_math, int64_t threads);
"""
_ARG_TYPES = [
    "void*",
    "int64_t",
    "int64_t",
    "int64_t",
    "void*",
    "int64_t",
    "int64_t",
    "int64_t",
    "const int64_t*",
    "int64_t",
    "int64_t",
    "const void*",
    "const void*",
    "int64_t",
    "int64_t",
    "const int64_t*",
    "int64_t",
    "int64_t",
    "int64_t",
]
_NO_SECTION = torch.zeros(3, dtype=torch.long)


def rotary_cpu_kernel():
    """The compiled kernel (built on first use), or None where it cannot be built here."""
    return load_cpu_kernel("rotary_cpu.cpp", _DECLARATION, tuple(_ARG_TYPES))


def _takes(query: torch.Tensor, key: torch.Tensor, cos_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype in _DTYPES
        and key.dtype == query.dtype
        and cos_cache.dtype in _DTYPES
        and query.dim() == 3
        and key.dim() == 3
        and query.stride(-1) == 1
        and key.stride(-1) == 1
        and os.environ.get(DISABLE_ENV, "1") != "0"
        and rotary_cpu_kernel() is not None
    )


@functools.lru_cache(maxsize=64)
def _section_tensor(section: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(section, dtype=torch.long)


def apply_rotary_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    mrope_section: list[int] | None = None,
    float32_math: bool = False,
) -> None:
    """`apply_rotary_ref`'s contract and results: the first R dims of query [T, Hq, D] and key [T, Hk, D] rotated in
    place at positions [T] or [3, T] (M-RoPE sections); cos / sin caches [P, R/2]. `float32_math`: bf16 tensors
    rotate as float32 copies of them would and are rounded back once (`apply_rotary_float32_ref`)."""
    if not _takes(query, key, cos_cache) or (positions.dim() == 2 and mrope_section is None):
        if float32_math:
            return apply_rotary_float32_ref(query, key, positions, cos_cache, sin_cache, mrope_section)
        return apply_rotary_ref(query, key, positions, cos_cache, sin_cache, mrope_section)
    tokens = query.shape[0]
    if tokens == 0:
        return None
    half = cos_cache.shape[-1]
    if positions.dim() == 2 and sum(mrope_section) != half:
        raise ValueError(f"sum(mrope_section)={sum(mrope_section)} must equal rotary_dim/2={half}")
    pos = (
        positions
        if positions.dtype == torch.long and positions.is_contiguous()
        else (positions.to(torch.long).contiguous())
    )
    cos, sin = cos_cache.contiguous(), sin_cache.contiguous()
    section = _NO_SECTION if positions.dim() == 1 else _section_tensor(tuple(mrope_section))
    rotary_cpu_kernel()(
        query,
        query.stride(0),
        query.stride(1),
        query.shape[1],
        key,
        key.stride(0),
        key.stride(1),
        key.shape[1],
        pos,
        1 if positions.dim() == 1 else 3,
        tokens,
        cos,
        sin,
        int(cos.dtype is torch.bfloat16),
        half,
        section,
        int(query.dtype is torch.bfloat16),
        int(float32_math),
        torch.get_num_threads(),
    )
    return None
