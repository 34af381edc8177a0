"""Paged decode attention for CPU in C++: one pass over each sequence's cached blocks, no gather, no mask.

Each OpenMP task is one sequence with all its KV heads (or a group of them when the batch is too small to keep
every thread busy). Its query heads (Hq/Hkv per KV head: GQA) read the sequence's keys and values block by block,
each cached position once, straight from the paged caches, with an online softmax in float32 (running max and
sum, as flash attention does): one read of the context, nothing copied or padded. Positions past a sequence's
length are never read, so stale cache slots cannot leak into the output. The loads, dot products and exponentials
are at::vec vectors (AVX-512 or AVX2, whichever inductor detects); bf16 is widened to float32 as it is loaded.

The source is compiled once per process, through the C++ toolchain torch's inductor uses for its CPU kernels (its
on-disk cache keeps the library across processes). Where no compiler works, `cpu_decode_kernel()` returns None and
the torch path (`attention_ref.paged_attention_decode_ref`) runs instead.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

using fVec = at::vec::Vectorized<float>;
using bf16 = c10::BFloat16;

// fVec::size() consecutive elements as float32
static inline fVec load(const float* p) { return fVec::loadu(p); }
static inline fVec load(const bf16* p) {
    fVec out;
    at::vec::load_fp32_from_bf16(p, out);
    return out;
}

// q, out: [B, Hq, D]; kc, vc: [NB, BS, Hkv, D]; tables: [B, M] int32; lens: [B] int32; D % fVec::size() == 0
template <typename T>
static void decode(const T* q, const T* kc, const T* vc, const int32_t* tables, const int32_t* lens, T* out,
                   int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t M, float scale,
                   int64_t threads) {
    const int64_t G = Hq / Hkv;
    const int64_t W = fVec::size();
    const int64_t pos_stride = Hkv * D;  // elements between consecutive positions
    // A task is one sequence and a group of its KV heads: all of them when there are sequences enough to keep
    // the threads busy (each cache line of a position is then read by one task), fewer for small batches.
    int64_t group = Hkv;
    while (group % 2 == 0 && B * (Hkv / group) < 2 * threads) group /= 2;
    const int64_t R = group * G;  // query rows per task; row r reads KV head h0 + r / G
    const int64_t tasks = B * (Hkv / group);
#pragma omp parallel num_threads(threads)
    {
        // per thread: the query rows (scaled), their accumulators, running max and sum, one block's scores
        std::vector<float> qf(R * D), acc(R * D), m(R), l(R), s(R * BS);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t b = task / (Hkv / group), h0 = task % (Hkv / group) * group;
            const int64_t len = lens[b];
            const T* qb = q + (b * Hq + h0 * G) * D;  // the task's R query rows are consecutive
            for (int64_t r = 0; r < R; ++r) {
                for (int64_t d = 0; d < D; d += W) (load(qb + r * D + d) * fVec(scale)).store(&qf[r * D + d]);
                m[r] = -FLT_MAX;
                l[r] = 0.f;
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            const int64_t nblk = (len + BS - 1) / BS;
            for (int64_t blk = 0; blk < nblk; ++blk) {
                const int64_t offset = static_cast<int64_t>(tables[b * M + blk]) * BS * pos_stride + h0 * D;
                const T* kb = kc + offset;
                const T* vb = vc + offset;
                const int64_t n = std::min(BS, len - blk * BS);
                for (int64_t t = 0; t < n; ++t) {  // scores: a key row is read once for the G query rows of its head
                    for (int64_t r = 0; r < R; ++r) {
                        const T* krow = kb + t * pos_stride + (r / G) * D;
                        fVec dot(0.f);
                        for (int64_t d = 0; d < D; d += W)
                            dot = at::vec::fmadd(fVec::loadu(&qf[r * D + d]), load(krow + d), dot);
                        s[r * BS + t] = dot.reduce_add();
                    }
                }
                for (int64_t r = 0; r < R; ++r) {  // online softmax: rescale what came before to the new max
                    float* sr = &s[r * BS];
                    const float mx = std::max(m[r], *std::max_element(sr, sr + n));
                    fVec vsum(0.f);
                    int64_t t = 0;
                    for (; t + W <= n; t += W) {  // whole vectors of scores
                        const fVec e = (fVec::loadu(sr + t) - fVec(mx)).exp();
                        e.store(sr + t);
                        vsum = vsum + e;
                    }
                    float sum = vsum.reduce_add();
                    for (; t < n; ++t) {  // the ragged end of the last block
                        sr[t] = std::exp(sr[t] - mx);
                        sum += sr[t];
                    }
                    const float corr = std::exp(m[r] - mx);  // 0 on the first block (m = -FLT_MAX)
                    l[r] = l[r] * corr + sum;
                    m[r] = mx;
                    if (corr != 1.f)
                        for (int64_t d = 0; d < D; d += W) (fVec::loadu(&acc[r * D + d]) * fVec(corr)).store(&acc[r * D + d]);
                }
                for (int64_t t = 0; t < n; ++t) {  // values: each row read once for the G query rows of its head
                    for (int64_t r = 0; r < R; ++r) {
                        const T* vrow = vb + t * pos_stride + (r / G) * D;
                        const fVec p(s[r * BS + t]);
                        for (int64_t d = 0; d < D; d += W)
                            at::vec::fmadd(p, load(vrow + d), fVec::loadu(&acc[r * D + d])).store(&acc[r * D + d]);
                    }
                }
            }
            for (int64_t r = 0; r < R; ++r) {
                const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
                T* orow = out + (b * Hq + h0 * G + r) * D;
                for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[r * D + d] * inv);
            }
        }
    }
}

extern "C" void kernel(const void* q, const void* kc, const void* vc, const int32_t* tables, const int32_t* lens,
                       void* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t M,
                       float scale, int64_t threads, int64_t is_bf16) {
    if (is_bf16)
        decode(static_cast<const bf16*>(q), static_cast<const bf16*>(kc), static_cast<const bf16*>(vc), tables, lens,
               static_cast<bf16*>(out), B, Hq, Hkv, D, BS, M, scale, threads);
    else
        decode(static_cast<const float*>(q), static_cast<const float*>(kc), static_cast<const float*>(vc), tables,
               lens, static_cast<float*>(out), B, Hq, Hkv, D, BS, M, scale, threads);
}
"""

_DECLARATION = """
#include <cstdint>
extern "C" void kernel(const void* q, const void* kc, const void* vc, const int32_t* tables, const int32_t* lens,
                       void* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS, int64_t M,
                       float scale, int64_t threads, int64_t is_bf16);
"""
_ARG_TYPES = ["const void*", "const void*", "const void*", "const int32_t*", "const int32_t*", "void*",
              "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "float", "int64_t", "int64_t"]
_DTYPES = (torch.float32, torch.bfloat16)
DISABLE_ENV = "VLSERVE_CPU_DECODE_KERNEL"  # "0": decode with the torch gather + SDPA path instead


@functools.cache
def cpu_decode_kernel():
    """The compiled kernel (built on first use), or None where it cannot be built here."""
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        # the kernel goes in as `kernel_code`, which inductor builds with its vector ISA flags (CPU_CAPABILITY_*,
        # which select at::vec's AVX2/AVX-512 code); the bindings only see its declaration
        return CppPythonBindingsCodeCache.load_pybinding(_ARG_TYPES, _DECLARATION, kernel_code=_SOURCE,
                                                         kernel_needs_vec_isa=True)
    except Exception as exc:  # no compiler, or an inductor without this loader: the torch path runs instead
        logger.warning("the C++ CPU decode attention could not be built (%s: %s); using the torch path",
                       type(exc).__name__, exc)
        return None


def cpu_decode_supported(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `paged_attention_decode_cpu` takes these tensors: CPU, float32 or bfloat16 query and cache, a head
    dim that is a multiple of 16 (whole vectors), a kernel built here, and not switched off by $VLSERVE_CPU_DECODE_KERNEL=0."""
    return (query.device.type == "cpu" and query.dtype in _DTYPES and k_cache.dtype == query.dtype
            and query.shape[-1] % 16 == 0 and os.environ.get(DISABLE_ENV, "1") != "0"
            and cpu_decode_kernel() is not None)


def paged_attention_decode_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               out: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attention_decode_ref`'s contract in one C++ call (check `cpu_decode_supported` first)."""
    # query: [B, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D]; block_tables: [B, M] int32; seq_lens: [B] int32
    num_seqs, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    query = query.contiguous()
    result = out if out.is_contiguous() else torch.empty_like(query)
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    cpu_decode_kernel()(query, k_cache.contiguous(), v_cache.contiguous(), tables, lens, result, num_seqs,
                        num_q_heads, num_kv_heads, head_dim, block_size, tables.shape[1], float(scale),
                        torch.get_num_threads(), int(query.dtype == torch.bfloat16))
    if result is not out:
        out.copy_(result)
    return out
