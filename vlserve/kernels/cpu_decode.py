"""Paged decode attention for CPU in C++: one pass over each sequence's cached blocks, no gather, no mask.

One call per layer and step (`attention_step_cpu`) first writes the step's keys and values into the paged caches,
then attends its query rows: the decodes, and the tokens of short prefill chunks (`kernel_rows`: up to
MAX_KERNEL_QUERY_LEN tokens each, e.g. chunked prefill or speculative verification), each such token a row of its
own that reads its sequence's table up to its causal length (with a sliding window W: only its last W positions,
the blocks wholly below them skipped). Each OpenMP task is one row with all its KV heads (or
a group of them when the batch is too small to keep every thread busy). Its query heads (Hq/Hkv per KV head: GQA) read the sequence's keys and values
straight from the paged caches, a chunk of blocks (~256 positions) at a time: the chunk's scores, one online
softmax update in float32 (running max and sum, as flash attention does), then its values. Positions past a
sequence's length are never read, so stale cache slots cannot leak into the output. The loads, dot products and
exponentials are at::vec vectors (AVX-512 or AVX2, whichever inductor detects; bf16 is widened to float32 as it is
loaded, or, on CPUs with AVX512-BF16, its scores are vdpbf16ps dot products of the raw bf16 rows); rows of 64 or
128 get code whose query rows and accumulators stay in registers, two or four query rows share each key or value
load, and the scores of eight positions are summed in one shuffle tree.

FP8 caches (float8_e4m3fn, `kv_quant`): the write divides by k_scale / v_scale, clamps and rounds each element;
reads widen each e4m3 byte to float32 in registers (shifted into an IEEE half, which the hardware widens: exact,
subnormals included), k_scale is folded into the scaled query rows and v_scale into the final normalization. The
float32/bf16 caches run the same code as before (their scales are 1).

The source is compiled once per process, through the C++ toolchain torch's inductor uses for its CPU kernels (its
on-disk cache keeps the library across processes). Where no compiler works, `cpu_decode_kernel()` returns None and
the torch path (`attention_ref.paged_attention_decode_ref`, `kv_write_ref`) runs instead.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from vlserve.kernels.cpp_build import load_cpu_kernel
from vlserve.kernels.kv_quant import is_fp8

_BF16_DOT = torch.cpu._is_avx512_bf16_supported()  # built for AVX512-BF16: bf16 scores through vdpbf16ps
_PREFIX = '#pragma GCC target("avx512bf16")\n' if _BF16_DOT else ""  # before csrc/cpu_decode.cpp

_DECLARATION = """
#include <cstdint>
extern "C" void kernel(const void* q, int64_t q_stride, const void* key, const void* value, int64_t k_stride, int64_t v_stride,
                       const int64_t* slots, int64_t num_writes, void* kc, void* vc, const int32_t* tables,
                       const int32_t* lens, const int32_t* row_seq, int64_t has_row_seq, void* out, int64_t B,
                       int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t M, float scale, int64_t threads,
                       int64_t is_bf16, int64_t dp_bf16, float k_scale, float v_scale, int64_t cache_fp8,
                       int64_t window);
"""
_ARG_TYPES = [
    "const void*",
    "int64_t",
    "const void*",
    "const void*",
    "int64_t",
    "int64_t",
    "const int64_t*",
    "int64_t",
    "void*",
    "void*",
    "const int32_t*",
    "const int32_t*",
    "const int32_t*",
    "int64_t",
    "void*",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
    "float",
    "int64_t",
    "int64_t",
    "int64_t",
    "float",
    "float",
    "int64_t",
    "int64_t",
]
_NO_SLOTS = torch.empty(0, dtype=torch.long)
_NO_ROWS = torch.empty(0, dtype=torch.int32)
MAX_KERNEL_QUERY_LEN = 32  # a prefill chunk of up to this many tokens runs in the kernel, row by row
_MAX_HEAD_DIM = 256  # kMaxVecs vectors of the narrowest ISA (AVX2: 8 floats)
_DTYPES = (torch.float32, torch.bfloat16)
_DP_BF16 = int(_BF16_DOT)  # 0: bf16 scores on widened float32 vectors even where vdpbf16ps was built in
DISABLE_ENV = "VLSERVE_CPU_DECODE_KERNEL"  # "0": decode with the torch gather + SDPA path instead


@functools.cache
def cpu_decode_kernel():
    """The compiled kernel (built on first use), or None where it cannot be built here."""
    # the kernel goes in as `kernel_code`, which inductor builds with its vector ISA flags (CPU_CAPABILITY_*, which
    # select at::vec's AVX2/AVX-512 code); the bindings only see its declaration
    return load_cpu_kernel("cpu_decode.cpp", _DECLARATION, tuple(_ARG_TYPES), _PREFIX, "the torch path")


def cpu_decode_supported(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `paged_attention_decode_cpu` and `attention_step_cpu` take these tensors: CPU, float32 or bfloat16
    query, a cache of the query's dtype or float8_e4m3fn, a head dim that is a multiple of 16 (whole vectors) up to
    256, a kernel built here, and not switched off by $VLSERVE_CPU_DECODE_KERNEL=0."""
    head_dim = query.shape[-1]
    return (
        query.device.type == "cpu"
        and query.dtype in _DTYPES
        and (k_cache.dtype == query.dtype or is_fp8(k_cache))
        and head_dim % 16 == 0
        and head_dim <= _MAX_HEAD_DIM
        and os.environ.get(DISABLE_ENV, "1") != "0"
        and cpu_decode_kernel() is not None
    )


def attention_step_supported(
    query: torch.Tensor, key: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> bool:
    """Whether `attention_step_cpu` takes these tensors: `cpu_decode_supported`, key in the query's dtype (copied
    in as it is, or quantized into an FP8 cache), and caches it can write in place (contiguous, one dtype)."""
    return (
        cpu_decode_supported(query, k_cache)
        and key.dtype == query.dtype
        and v_cache.dtype == k_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`x` [N, H, D] (or a copy) with each row's [H, D] contiguous, and the elements between rows."""
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        x = x.contiguous()
    return x, x.stride(0)


@dataclass(frozen=True)
class StepRows:
    """What every layer's `attend_rows` call of a step reads from its metadata, in the dtypes and layout the C++
    call takes: converted once a step (`step_rows`) instead of once per layer."""

    slots: torch.Tensor  # [T] int64 contiguous: where each row's key/value goes (-1: skipped)
    tables: torch.Tensor  # [S, M] int32, each row contiguous
    lens: torch.Tensor  # [>= num_rows] int32 contiguous: positions row r attends to
    seqs: torch.Tensor  # [num_rows] int32: the table row of each query row; empty: row r reads table row r
    num_rows: int


def step_rows(
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    row_lens: torch.Tensor,
    num_rows: int,
    row_seqs: torch.Tensor | None = None,
) -> StepRows:
    """`StepRows` from a step's slot_mapping [T], block_tables [S, M], row_lens and (optional) row_seqs."""
    tables = (
        block_tables
        if block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
        else (block_tables.to(torch.int32).contiguous())
    )
    return StepRows(
        slot_mapping.to(torch.long).contiguous(),
        tables,
        row_lens.to(torch.int32).contiguous(),
        _NO_ROWS if row_seqs is None else row_seqs.to(torch.int32).contiguous(),
        num_rows,
    )


def attend_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: StepRows,
    scale: float,
    out: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> None:
    """One C++ call: write key/value [T, Hkv, D] into the caches at rows.slots, then attend the first rows.num_rows
    rows of query [T, Hq, D] into out [T, Hq, D] (contiguous). The caller checks `attention_step_supported`. FP8
    caches are written and read with k_scale / v_scale; other caches ignore them. `sliding_window` W: a row of
    length L attends only to positions max(0, L - W) .. L - 1 (None: all)."""
    # k_cache, v_cache: [NB, BS, Hkv, D] contiguous
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    query, q_stride = _rows(query)
    key, k_stride = _rows(key)
    value, v_stride = _rows(value)
    seqs = rows.seqs
    fp8 = is_fp8(k_cache)
    cpu_decode_kernel()(
        query,
        q_stride,
        key,
        value,
        k_stride,
        v_stride,
        rows.slots,
        rows.slots.shape[0],
        k_cache,
        v_cache,
        rows.tables,
        rows.lens,
        seqs,
        int(seqs.shape[0] > 0),
        out,
        rows.num_rows,
        query.shape[1],
        num_kv_heads,
        head_dim,
        block_size,
        rows.tables.stride(0),
        float(scale),
        torch.get_num_threads(),
        int(query.dtype == torch.bfloat16),
        _DP_BF16,
        float(k_scale) if fp8 else 1.0,
        float(v_scale) if fp8 else 1.0,
        int(fp8),
        int(sliding_window or 0),
    )


def attention_step_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    row_lens: torch.Tensor,
    num_rows: int,
    scale: float,
    out: torch.Tensor,
    row_seqs: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> None:
    """One C++ call: write key/value [T, Hkv, D] into the caches at slot_mapping [T] (int64; -1 skipped), then
    attend the first `num_rows` rows of query [T, Hq, D] into out [T, Hq, D] (contiguous): row r reads the positions
    0 .. row_lens[r] - 1 of table row row_seqs[r] (default: r, one decode token per sequence). The caller checks
    `attention_step_supported`; rows past `num_rows` are left to it. FP8 caches and `sliding_window`: see
    `attend_rows`."""
    attend_rows(
        query,
        key,
        value,
        k_cache,
        v_cache,
        step_rows(slot_mapping, block_tables, row_lens, num_rows, row_seqs),
        scale,
        out,
        k_scale,
        v_scale,
        sliding_window,
    )


def kernel_rows(
    query_start_loc: list[int], seq_lens: list[int], num_decodes: int, max_query_len: int = MAX_KERNEL_QUERY_LEN
) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """The query rows `attention_step_cpu` takes in a step: `(num_rows, row_seqs, row_lens)`. The decodes always;
    the prefill chunks too when none is longer than `max_query_len` (token i of a chunk of q over a context of L
    attends to positions 0 .. L - q + i), with row_seqs/row_lens to say so (max_query_len 0: the decodes only, as for
    a step with key limits). Without prefill rows both are None (the caller passes seq_lens). ValueError when a chunk
    is longer than its context."""
    chunks = [(query_start_loc[b + 1] - query_start_loc[b], seq_lens[b]) for b in range(num_decodes, len(seq_lens))]
    for b, (q_len, seq_len) in enumerate(chunks, start=num_decodes):
        if q_len > seq_len:
            raise ValueError(f"sequence {b}: q_len {q_len} > seq_len {seq_len}")
    if not chunks or max(q for q, _ in chunks) > max_query_len:
        return num_decodes, None, None
    seqs, lens = list(range(num_decodes)), seq_lens[:num_decodes]
    for b, (q_len, seq_len) in enumerate(chunks, start=num_decodes):
        seqs += [b] * q_len
        lens += range(seq_len - q_len + 1, seq_len + 1)
    return len(seqs), torch.tensor(seqs, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def paged_attention_decode_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`paged_attention_decode_ref`'s contract in one C++ call (check `cpu_decode_supported` first)."""
    # query: [B, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D]; block_tables: [B, M] int32; seq_lens: [B] int32
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    result = out if out.is_contiguous() else torch.empty_like(query)
    attention_step_cpu(
        query,
        query[:0],
        query[:0],
        k_cache.contiguous(),
        v_cache.contiguous(),
        _NO_SLOTS,
        block_tables,
        seq_lens,
        query.shape[0],
        scale,
        result,
        k_scale=k_scale,
        v_scale=v_scale,
        sliding_window=sliding_window,
    )
    if result is not out:
        out.copy_(result)
    return out
