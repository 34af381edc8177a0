"""Structured outputs' token bitmask applied to logits on CPU in C++, and the numpy + torch reference it must match.

The bitmask is int32 words [R, W]: bit j of word w set means token 32 w + j is allowed; tokens at or past 32 W are
forbidden and bits past the vocabulary are ignored. The reference unpacks the words into a bool [R, V] tensor with
numpy and runs `masked_fill_`: about 8 ms per step at a 151,936-token vocabulary and 32 rows on 2 AVX2 cores,
whatever the mask. The C++ pass (csrc/grammar_mask.cpp) walks each row's words instead: a run of all-ones words is
skipped (eight words a compare), a run of all-zero words becomes one fill of -inf, and a word with both kinds of bits
blends -inf into just its forbidden logits (AVX2: four 8-lane blends for float32, two 16-lane ones for bf16 and
float16, the bits moved into lane masks). It writes -inf's bit pattern in the logits' dtype, as masked_fill does, so
the two agree bit for bit. Rows, or ranges of a row's words when there are fewer rows than threads, are shared out
over torch.get_num_threads() OpenMP threads; small masks (under 32k tokens a thread) run on one.

The source is built through inductor's C++ toolchain on first use, like `cpu_decode`. Where no compiler works or
$VLSERVE_CPU_GRAMMAR_MASK_KERNEL is "0", `grammar_mask_supported` is False and callers keep the reference.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from vlserve.kernels.cpp_build import load_cpu_kernel
from vlserve.kernels.host_copy import tensor_to_device, to_device

_DECLARATION = """
#include <cstdint>
extern "C" void kernel(void* logits, int64_t ld, const int32_t* mask, int64_t ldm, const int64_t* logit_rows,
                       const int64_t* mask_rows, int64_t has_rows, int64_t R, int64_t V, int64_t W, int64_t dtype,
                       int64_t threads);
"""
_ARG_TYPES = [
    "void*",
    "int64_t",
    "const int32_t*",
    "int64_t",
    "const int64_t*",
    "const int64_t*",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
]
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NO_ROWS = torch.empty(0, dtype=torch.int64)
DISABLE_ENV = "VLSERVE_CPU_GRAMMAR_MASK_KERNEL"  # "0": mask with the numpy + torch reference instead


@functools.cache
def grammar_mask_kernel():
    """The compiled pass (built on first use), or None where it cannot be built here."""
    return load_cpu_kernel("grammar_mask.cpp", _DECLARATION, tuple(_ARG_TYPES), fallback="the numpy path")


def grammar_mask_supported(logits: torch.Tensor) -> bool:
    """Whether `apply_token_bitmask_cpu` takes these logits: a CPU [N, V] tensor of float32, bfloat16 or float16
    with unit stride along V, a pass built here, and not switched off by $VLSERVE_CPU_GRAMMAR_MASK_KERNEL=0."""
    return (
        logits.device.type == "cpu"
        and logits.dtype in _DTYPE_CODES
        and logits.dim() == 2
        and logits.stride(1) == 1
        and os.environ.get(DISABLE_ENV, "1") != "0"
        and grammar_mask_kernel() is not None
    )


def _words(bitmask: np.ndarray | torch.Tensor) -> torch.Tensor:
    """The bitmask as a CPU int32 tensor [M, W] with contiguous rows (no copy when it already is one)."""
    if isinstance(bitmask, np.ndarray):
        if not (bitmask.flags.c_contiguous and bitmask.flags.writeable):
            bitmask = np.array(bitmask, order="C")  # torch.from_numpy takes no read-only or reversed arrays
        bitmask = torch.from_numpy(bitmask)
    words = bitmask
    if words.dtype != torch.int32:
        raise ValueError(f"the token bitmask must be int32 words, got {words.dtype}")
    return words if words.stride(-1) == 1 else words.contiguous()


def apply_token_bitmask_cpu(
    logits: torch.Tensor,
    bitmask: np.ndarray | torch.Tensor,
    logit_rows: list[int] | None = None,
    mask_rows: list[int] | None = None,
    threads: int | None = None,
) -> None:
    """Set the logits a bitmask forbids to -inf, in place, in one C++ call (check `grammar_mask_supported`).
    logits [N, V]; bitmask int32 [M, W]; logit row logit_rows[i] takes mask row mask_rows[i], or, without them, row
    i takes row i (then N == M). threads: at most this many (default torch.get_num_threads())."""
    words = _words(bitmask)  # [M, W]
    n, vocab = logits.shape
    if logit_rows is None:
        if n != words.shape[0]:
            raise ValueError(f"{n} logit rows and {words.shape[0]} bitmask rows, and no row mapping")
        lrows = mrows = _NO_ROWS
        count = n
    else:
        lrows = torch.tensor(logit_rows, dtype=torch.int64)  # [R]
        mrows = torch.tensor(mask_rows, dtype=torch.int64)  # [R]
        count = len(logit_rows)
    if count and vocab:
        grammar_mask_kernel()(
            logits,
            logits.stride(0),
            words,
            words.stride(0),
            lrows,
            mrows,
            int(logit_rows is not None),
            count,
            vocab,
            words.shape[1],
            _DTYPE_CODES[logits.dtype],
            threads or torch.get_num_threads(),
        )


def unpack_bitmask(words: np.ndarray, vocab_size: int) -> torch.Tensor:
    """int32 words [R, W] (bit j of word w: token 32 * w + j is allowed) -> bool [R, vocab_size]; tokens past the
    bitmask's width are not allowed. Unpacked by numpy from the words' bytes (little-endian hosts)."""
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=1, bitorder="little")  # [R, 32 W]
    if bits.shape[1] >= vocab_size:
        return torch.from_numpy(bits[:, :vocab_size]).to(torch.bool)
    padded = np.zeros((bits.shape[0], vocab_size), dtype=np.uint8)
    padded[:, : bits.shape[1]] = bits
    return torch.from_numpy(padded).to(torch.bool)


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: np.ndarray, logit_rows: list[int] | None = None, mask_rows: list[int] | None = None
) -> None:
    """`apply_token_bitmask_cpu`'s contract through numpy's unpack and `masked_fill` (any device)."""
    words = bitmask if mask_rows is None else bitmask[mask_rows]  # [R, W]
    allowed = to_device(unpack_bitmask(words, logits.shape[-1]), logits.device)  # [R, V]
    if logit_rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    rows = tensor_to_device(logit_rows, torch.long, logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
