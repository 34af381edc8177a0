"""Attention of many segments on CPU in one C++ call (csrc/varlen_attention_cpu.cpp), no padding, no mask.

Two sources of keys: `segment_attention_cpu` attends each segment of rows of q / k / v to itself, causally or both
ways (towers, text towers, cross-encoders: many segments of tens of tokens, where SDPA pays per call and per padded
row); `paged_segments_cpu` attends a step's prefill chunks (tens to a couple of hundred tokens, with or without a
cached prefix) to their context in the paged KV cache, after the step's K/V are written. A query row's result depends
only on its query and the keys it sees, so a prefix-cache hit does not change it.

Scores, softmax and the weighted sum run in float32 (bf16 widened on load, the output rounded once), so a bf16 result
can sit one bf16 step from SDPA's, and a float32 one differs in the summation order only. Where the kernel is built
with AMX-BF16 or AVX512-BF16 (`bf16_pair_engine`), bf16 heads multiply as bf16 pairs instead, zero-padded to a
multiple of 32 (csrc/attention_pairs.h; on AVX512-BF16 only tasks of 8 query rows and 16 keys or more): flash
attention over panels of keys, float32 scores and softmax, the unnormalized weights rounded to bf16 before the
weighted sum (as torch's CPU flash attention does). Segments longer than
`max_segment_len(causal, dtype, head_dim)` stay with SDPA, which tiles them into matrix products. Taken for float32 /
bf16 CPU tensors whose heads are contiguous rows of D elements, outside autograd and torch.compile, where the kernel
builds and $VLSERVE_CPU_VARLEN_ATTENTION_KERNEL is not 0.
"""

from __future__ import annotations

import functools
import os

import torch

from vlserve.kernels.cpp_build import load_cpu_kernel

DISABLE_ENV = "VLSERVE_CPU_VARLEN_ATTENTION_KERNEL"
# longest segment `varlen_attention` sends to the kernel's widened path, by (causal, dtype): SDPA's tiled matrix
# products win past these. Measured on the AMX Xeon (one thread, 8 query / 2 KV heads of 64; bf16 SDPA runs on AMX),
# and held on every CPU but the AVX-512 one without AMX (`bf16_pair_engine()` "avx512_bf16"), where eight rows a block
# measured 1.2-1.9x SDPA causal up to 2,048 rows and 0.95-1.17x both ways in float32 (and no gather), 2 threads (bf16
# heads there take the pairs' limits)
_MAX_SEGMENT_LEN = {
    (True, torch.bfloat16): 128,
    (True, torch.float32): 256,
    (False, torch.bfloat16): 64,
    (False, torch.float32): 128,
}
_AVX512_MAX_SEGMENT_LEN = {
    (True, torch.bfloat16): 1024,
    (True, torch.float32): 2048,
    (False, torch.bfloat16): 768,
    (False, torch.float32): 2048,
}
# bf16 pair products, by engine and causal. AMX tiles: the same machine and heads, 2 threads (the kernel beats SDPA up
# to about 128 rows both ways and 512 causal). vdpbf16ps (AVX-512 EPYC, 2 threads, heads of 64 and 128): 1.9-2.6x
# SDPA at every length measured, up to 4,096 rows
_PAIRS_MAX_SEGMENT_LEN = {"amx": {True: 512, False: 128}, "avx512_bf16": {True: 4096, False: 4096}}
_PREFIX = '#pragma GCC target("avx512bf16")\n' if torch.cpu._is_avx512_bf16_supported() else ""
MAX_SEGMENT_QUERY_LEN = 192  # a paged prefill chunk's query rows (its alternative pads and gathers) ...
MAX_SEGMENT_CONTEXT = 1024  # ... and the context they attend to (bf16 pairs on vdpbf16ps: `paged_segment_limits`)
_DECLARATION = """
#include <cstdint>
extern "C" void kernel(const void* q, const void* k, const void* v, void* out, int64_t q_ld, int64_t k_ld,
                       int64_t v_ld, int64_t o_ld, const int64_t* q_starts, const int64_t* q_lens,
                       const int64_t* kv_starts, const int64_t* kv_lens, const int32_t* tables, int64_t M,
                       int64_t BS, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, float scale, int64_t causal,
                       int64_t is_bf16, int64_t threads);
"""
_ARG_TYPES = ("const void*", "const void*", "const void*", "void*", "int64_t", "int64_t", "int64_t", "int64_t",
              "const int64_t*", "const int64_t*", "const int64_t*", "const int64_t*", "const int32_t*", "int64_t",
              "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "float", "int64_t", "int64_t",
              "int64_t")  # fmt: skip
_NO_TABLES = torch.empty(0, dtype=torch.int32)


def varlen_attention_cpu_kernel():
    """The compiled kernel (built on first use, for AVX512-BF16 where the CPU has it), or None where it cannot be
    built here."""
    return load_cpu_kernel("varlen_attention_cpu.cpp", _DECLARATION, _ARG_TYPES, _PREFIX)


@functools.cache
def bf16_pair_engine() -> str | None:
    """What multiplies bf16 heads in the kernel built here: "amx" (tiles), "avx512_bf16"
    (vdpbf16ps) or None (widened to float32). A call with S = -1 writes it."""
    kernel = varlen_attention_cpu_kernel()
    if kernel is None:
        return None
    report, none = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    kernel(none, none, none, report, 0, 0, 0, 0, none, none, none, none, _NO_TABLES, 0, 0, -1, 1, 1, 32, 1.0, 0, 1, 1)
    return {0: None, 1: "avx512_bf16", 2: "amx"}[int(report)]


def max_segment_len(causal: bool, dtype: torch.dtype, head_dim: int = 0) -> int:
    """The longest segment `varlen_attention` sends to the kernel (longer ones are faster through SDPA)."""
    engine = bf16_pair_engine()
    if engine is not None and dtype == torch.bfloat16 and head_dim > 0:
        return _PAIRS_MAX_SEGMENT_LEN[engine][causal]
    limits = _AVX512_MAX_SEGMENT_LEN if engine == "avx512_bf16" else _MAX_SEGMENT_LEN
    return limits.get((causal, dtype), 0)


@functools.cache  # asked per layer and step
def paged_segment_limits(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    """(query rows, context) of the longest prefill chunk `paged_segments_cpu` takes for heads of this dtype and size;
    past either the torch prefill's batched SDPA is faster. On the AVX-512 CPU without AMX the kernel beat it at every
    causal length measured (bf16 pairs, and the widened path's eight-row blocks), so the causal segment limit holds
    there."""
    if bf16_pair_engine() == "avx512_bf16":
        limit = max_segment_len(True, dtype, head_dim)
        return limit, limit
    return MAX_SEGMENT_QUERY_LEN, MAX_SEGMENT_CONTEXT


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


def _run(query, key, value, out, q_starts, q_lens, kv_starts, kv_lens, tables, block_size, scale, causal) -> None:
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    varlen_attention_cpu_kernel()(
        query,
        key,
        value,
        out,
        query.stride(0),
        key.stride(0) if tables is _NO_TABLES else key.shape[2] * key.shape[3],
        value.stride(0) if tables is _NO_TABLES else value.shape[2] * value.shape[3],
        out.stride(0),
        as_tensor(q_starts),
        as_tensor(q_lens),
        as_tensor(kv_starts),
        as_tensor(kv_lens),
        tables,
        tables.shape[1] if tables.dim() == 2 else 0,
        block_size,
        len(q_starts),
        query.shape[1],
        key.shape[-2],
        query.shape[2],
        float(scale),
        int(causal),
        int(query.dtype is torch.bfloat16),
        torch.get_num_threads(),
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
    _run(query, key, value, out, starts, lens, starts, lens, _NO_TABLES, 0, scale, causal)


def paged_segments_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seqs: list[int],
    q_starts: list[int],
    q_lens: list[int],
    seq_lens: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Causal attention of sequence seqs[i]'s q_lens[i] query rows (from q_starts[i]; the last of its seq_lens[i]
    positions) over its cached keys and values, already written, into the same rows of `out`. Check
    `paged_kernel_takes` first."""
    # query, out: [T, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D] contiguous; block_tables: [B, M] int32
    if not seqs:
        return
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    _run(query, k_cache, v_cache, out, q_starts, q_lens, seqs, seq_lens, tables.contiguous(), k_cache.shape[1],
         scale, True)  # fmt: skip


def paged_kernel_takes(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether `paged_segments_cpu` runs these tensors: the caches contiguous and in the query's dtype."""
    return (
        k_cache.dtype == query.dtype
        and v_cache.dtype == query.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k_cache.dim() == 4
        and segment_kernel_takes(query, k_cache[0], v_cache[0], out)
    )
