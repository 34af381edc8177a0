"""bf16 linears through oneDNN on a matrix prepacked once (CPUs with AMX).

torch's `F.linear` on a plain bf16 matrix has oneDNN reorder it into the AMX tile layout on every call; a matrix
reordered once at load (`torch.ops.mkldnn._reorder_linear_weight`) and multiplied by `mkldnn._linear_pointwise`
skips that. Measured on a 2-core AMX Xeon (docs/benchmarks.md): 1.2-2.3x faster than `F.linear` from 4 to 512
rows, even at thousands, and from 4 rows faster than the packed C++ kernel (`cpu_linear`), which stays faster at
1-2 rows; the sums came out equal to `F.linear`'s on every shape tried. Packed layers on such CPUs hold this form
instead of the plain matrix (`packed_linear`), towers hold only it.
"""

from __future__ import annotations

import torch

from vlserve.kernels.cpu_linear import _has_amx


def onednn_prepacks(dtype: torch.dtype) -> bool:
    """Whether a matrix of `dtype` is prepacked for oneDNN here: bf16 on CPUs with AMX, where this torch has the op."""
    return dtype is torch.bfloat16 and _has_amx() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def prepack_onednn(matrix: torch.Tensor) -> torch.Tensor | None:
    """bf16 [N, K] -> oneDNN's prepacked (opaque, MkldnnCPU) form of it, or None where `onednn_prepacks` says no."""
    if matrix.device.type != "cpu" or not onednn_prepacks(matrix.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(matrix.detach().contiguous(), None)


_LIB = torch.library.Library("vlserve", "FRAGMENT")
_LIB.define("onednn_linear(Tensor x, Tensor w, Tensor? bias, int out_features, str post_op='none') -> Tensor")

POST_OPS = ("none", "swish")  # applied by oneDNN to each sum before it is stored; swish(t) = t * sigmoid(t)


def padded_rows(m: int) -> int:
    """The row count a product of `m` rows runs at: oneDNN builds (JIT-compiles) a primitive per shape, about 10 ms
    each for a [2000 x 512] x [512 x 1536] bf16 product on a 2-core AMX Xeon (a tenth of the product at a size it
    has built), so batches whose row count changes from step to step would build one each step. Up to 16 rows run
    as they are; past that, rows are padded to one of 16 sizes an octave (at most 1/16 more rows)."""
    if m <= 16:
        return m
    step = 1 << (m.bit_length() - 5)  # 16 steps per octave [2^(b-1), 2^b)
    return -(-m // step) * step


def empty_rows(rows: int, *tail: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A new [rows, *tail] tensor whose storage has room for `padded_rows(rows)` rows: a oneDNN linear reads it
    (and the rows past it, whatever they hold) in place instead of copying it into a padded buffer."""
    return torch.empty(padded_rows(rows), *tail, dtype=dtype, device=device)[:rows]


def _room_for(rows: torch.Tensor, run: int) -> bool:
    # rows [M, K] contiguous, with `run` rows' worth of its storage from its first element on
    end = rows.storage_offset() + run * rows.shape[1]
    return rows.is_contiguous() and rows.untyped_storage().nbytes() >= end * rows.element_size()


def _onednn_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_features: int, post_op: str = "none"
) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    m = rows.shape[0]
    run = padded_rows(m)
    # the padding rows' products are never read (each output row reads only its own input row), so they may hold
    # anything: the storage past the rows where it has room (`empty_rows`, a linear's own output), else a copy
    if run != m and _room_for(rows, run):
        rows = rows.as_strided((run, rows.shape[1]), (rows.shape[1], 1))
    elif run != m:
        padded = rows.new_empty(run, rows.shape[1])
        padded[:m].copy_(rows)
        rows = padded
    elif rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.ops.mkldnn._linear_pointwise(rows, w, bias, post_op, [], "")  # [run, N]
    return (y if run == m else y[:m]).view(*x.shape[:-1], out_features)


def _fake(x, w, bias, out_features, post_op="none"):
    return x.new_empty(*x.shape[:-1], out_features)


for _key in ("CPU", "MkldnnCPU"):  # the prepacked matrix dispatches as MkldnnCPU
    _LIB.impl("onednn_linear", _onednn_linear, _key)
torch.library.register_fake("vlserve::onednn_linear")(_fake)


def onednn_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_features: int, post_op: str = "none"
) -> torch.Tensor:
    """x [..., K] bf16 times a `prepack_onednn` matrix (+ bias [N] in x.dtype) -> [..., N] in bf16, with `post_op`
    (one of POST_OPS) applied in float32 to each sum before its one rounding to bf16. An opaque op to
    torch.compile; eager calls skip its dispatch."""
    if post_op not in POST_OPS:
        raise ValueError(f"post_op must be one of {POST_OPS}, got {post_op!r}")
    run = torch.ops.vlserve.onednn_linear if torch.compiler.is_compiling() else _onednn_linear
    return run(x, w, None if bias is None else bias.to(x.dtype), out_features, post_op)
