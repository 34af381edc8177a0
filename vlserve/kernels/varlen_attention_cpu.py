"""Attention of many short segments over themselves on CPU in one C++ call (csrc/varlen_attention_cpu.cpp): each
segment's queries attend to its own keys only, causally or both ways, straight from the rows of q / k / v (no
padding, no mask, no gather). Short prompts (text embedders, cross-encoders, a batch of fresh chat prompts) and
small image tiles are many segments of tens to hundreds of tokens, where SDPA pays per call and per padded row.

Scores, softmax and the weighted sum run in float32 (bf16 rows widened on load, the output rounded once), so a bf16
result can sit one bf16 step from SDPA's, and a float32 one differs in the summation order only. Segments longer than
`max_segment_len(causal)` stay with SDPA, which tiles them into matrix products. Taken for float32 / bf16 CPU tensors whose
heads are contiguous rows of D elements, outside autograd and torch.compile, where the kernel builds and
$VLSERVE_CPU_VARLEN_ATTENTION_KERNEL is not 0.
"""

from __future__ import annotations

import os

import torch

from vlserve.kernels.cpp_build import load_cpu_kernel

DISABLE_ENV = "VLSERVE_CPU_VARLEN_ATTENTION_KERNEL"
# longest segment the kernel takes; SDPA's tiled matrix products win past these (bf16 and float32, AMX Xeon)
MAX_CAUSAL_SEGMENT_LEN = 192
MAX_BIDIRECTIONAL_SEGMENT_LEN = 96
_DECLARATION = """
#include <cstdint>
extern "C" void kernel(const void* q, const void* k, const void* v, void* out, int64_t q_ld, int64_t k_ld,
                       int64_t v_ld, int64_t o_ld, const int64_t* starts, const int64_t* lens, int64_t S, int64_t Hq,
                       int64_t Hkv, int64_t D, float scale, int64_t causal, int64_t is_bf16, int64_t threads);
"""
_ARG_TYPES = ("const void*", "const void*", "const void*", "void*", "int64_t", "int64_t", "int64_t", "int64_t",
              "const int64_t*", "const int64_t*", "int64_t", "int64_t", "int64_t", "int64_t", "float", "int64_t",
              "int64_t", "int64_t")  # fmt: skip


def varlen_attention_cpu_kernel():
    """The compiled kernel (built on first use), or None where it cannot be built here."""
    return load_cpu_kernel("varlen_attention_cpu.cpp", _DECLARATION, _ARG_TYPES)


def max_segment_len(causal: bool) -> int:
    """The longest segment callers send to the kernel (longer ones are faster through SDPA)."""
    return MAX_CAUSAL_SEGMENT_LEN if causal else MAX_BIDIRECTIONAL_SEGMENT_LEN


def _rows_of_heads(t: torch.Tensor) -> bool:
    # [T, H, D] with each head's D elements contiguous and heads adjacent within a row
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def segment_kernel_takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether `segment_attention_cpu` runs these tensors (else the caller's torch path)."""
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.bfloat16)
        and key.dtype == query.dtype
        and value.dtype == query.dtype
        and out.dtype == query.dtype
        and all(_rows_of_heads(t) for t in (query, key, value, out))
        and query.shape[1] % key.shape[1] == 0
        and value.shape[1] == key.shape[1]
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and os.environ.get(DISABLE_ENV, "1") != "0"
        and varlen_attention_cpu_kernel() is not None
    )


def segment_attention_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    starts: list[int],
    lens: list[int],
    scale: float,
    causal: bool,
    out: torch.Tensor,
) -> None:
    """Segment s (rows starts[s] .. starts[s] + lens[s]) of `query` attends to the same rows of `key` / `value`
    (causal: row i to rows 0..i of its segment), written into the same rows of `out`. Check
    `segment_kernel_takes` first."""
    # query, out: [T, Hq, D]; key, value: [T, Hkv, D]
    if not starts:
        return
    if min(starts) < 0 or min(lens) < 0 or max(s + n for s, n in zip(starts, lens)) > query.shape[0]:
        raise ValueError("every segment must lie within the rows")
    starts_t = torch.tensor(starts, dtype=torch.int64)
    lens_t = torch.tensor(lens, dtype=torch.int64)
    varlen_attention_cpu_kernel()(
        query,
        key,
        value,
        out,
        query.stride(0),
        key.stride(0),
        value.stride(0),
        out.stride(0),
        starts_t,
        lens_t,
        len(starts),
        query.shape[1],
        key.shape[1],
        query.shape[2],
        float(scale),
        int(causal),
        int(query.dtype is torch.bfloat16),
        torch.get_num_threads(),
    )
