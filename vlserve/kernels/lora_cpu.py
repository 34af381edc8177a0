"""A layer's whole LoRA delta for one step in one C++ call on CPU: what `kernels.lora_ref.add_lora_grouped` does with
a shrink and an expand matmul per (slot, output slice), done as one pass over the step's tokens.

For every token t whose slot s is in [0, L) and every output slice q (q/k/v of qkv_proj, gate/up of gate_up_proj,
the whole output of o_proj/down_proj) with rank r = ranks[s, q] > 0:

    out[t, off_q : off_q + n_q] += (x[t] @ A_q[s, :r]^T) @ B_q[s, :, :r]^T

with float32 sums and each out element rounded to its dtype once; tokens of slot -1 are not touched (bit-identical).

The kernel reads the weights in its own layout, a `LoRAStack` per layer (made once, written by set_lora):

- `a [L, S*R, I]`: the S slices' A matrices one after another per slot (slice q's rank-padded rows at q*R), so one
  pass over x[t] computes the shrink of every slice ("concatenated ranks");
- `b [L, R, Ob]`: the B matrices transposed and side by side at their output columns (`b[s, j, off_q + o]` =
  `B_q[s, o, j]`), so the expand walks contiguous output columns (8-lane FMAs along O, y broadcast);
- `ranks [L, S]` int32 and `slices [S, 2]` int64 (column offset, width).

`LoRAStack.lora_a_views()` / `lora_b_views()` return the per-slice `[L, R, I]` / `[L, O_q, R]` tensors the torch
twin and the checkpoint writer use as views into the stack, so a layer can keep one copy of its weights.

The C++ side (csrc/lora_cpu.cpp) groups the tokens by slot (a counting sort), then runs two phases over one OpenMP
team of up to torch.get_num_threads() threads (one thread for small steps): the shrink into a float32 y [T, S*R]
(units: up to 16 tokens of a slot x 16 of its active A rows; register blocks of 4 tokens x 2 rows), then the expand
(units: 64-column blocks of a slice over all tokens; register blocks of 2 tokens x 32 columns). The units do not
depend on the thread count, so the output is the same with 1 or N threads. `out` may also be a float32 delta buffer
for bf16 inputs (what `cpu_linear_silu_mul(..., pre_act_add=)` takes).

Built through inductor's C++ toolchain on first use, like `grammar_mask`. Where no compiler works or
$VLSERVE_CPU_LORA_KERNEL is "0", `lora_cpu_supported` is False and `lora_add` runs the torch twin.
"""

from __future__ import annotations

import os

import torch

from vlserve.kernels.cpp_build import load_cpu_kernel

_DECLARATION = """
#include <cstdint>
extern "C" void kernel(const void* x, int64_t ldx, void* out, int64_t ldo, const int64_t* slots, int64_t T,
                       const void* a, const void* b, const int32_t* ranks, const int64_t* slices, int64_t L, int64_t S,
                       int64_t R, int64_t I, int64_t Ob, int64_t dtype, int64_t out_f32, int64_t threads);
"""
_ARG_TYPES = [
    "const void*",
    "int64_t",
    "void*",
    "int64_t",
    "const int64_t*",
    "int64_t",
    "const void*",
    "const void*",
    "const int32_t*",
    "const int64_t*",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
    "int64_t",
]
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
DISABLE_ENV = "VLSERVE_CPU_LORA_KERNEL"  # "0": the torch twin (lora_ref.add_lora_grouped) instead


def lora_cpu_kernel():
    """The compiled kernel (built on first use; csrc/lora_cpu.cpp with the shared header pasted in), or None where it
    cannot be built here (the torch twin runs instead)."""
    return load_cpu_kernel("lora_cpu.cpp", _DECLARATION, tuple(_ARG_TYPES))


def lora_cpu_supported(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> bool:
    """Whether `lora_add_cpu` serves weights of `dtype` on `device`: CPU, float32 or bfloat16, a kernel built here,
    and not switched off by $VLSERVE_CPU_LORA_KERNEL=0. Cheap after the first call, but meant to be asked once per
    layer (at init_lora), not per step."""
    return (
        torch.device(device).type == "cpu"
        and dtype in _DTYPE_CODES
        and os.environ.get(DISABLE_ENV, "1") != "0"
        and lora_cpu_kernel() is not None
    )


class LoRAStack:
    """One layer's LoRA slots in the kernel's layout (see the module docstring): `a [L, S*R, I]`, `b [L, R, Ob]`,
    `ranks [L, S]` int32, `slices [S, 2]` int64 (offset, width of each output slice in out's columns)."""

    __slots__ = ("a", "b", "ranks", "slices", "max_rank", "offsets", "sizes", "kernel_args")

    def __init__(self, a: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor, offsets: list[int], sizes: list[int]):
        if not (a.is_contiguous() and b.is_contiguous() and ranks.is_contiguous() and ranks.dtype == torch.int32):
            raise ValueError("LoRAStack takes contiguous a, b and an int32 ranks tensor")
        self.a, self.b, self.ranks = a, b, ranks  # [L, S*R, I], [L, R, Ob], [L, S]
        self.max_rank = b.shape[1]
        self.offsets, self.sizes = list(offsets), list(sizes)
        self.slices = torch.tensor([[o, n] for o, n in zip(offsets, sizes)], dtype=torch.int64).reshape(-1, 2)
        L, SR, I = a.shape
        if (
            SR != len(sizes) * self.max_rank
            or b.shape[0] != L
            or b.shape[2] < max((o + n for o, n in zip(offsets, sizes)), default=0)
        ):
            raise ValueError(f"LoRAStack: a {tuple(a.shape)} and b {tuple(b.shape)} do not fit slices {sizes}")
        # what every call passes after x, out and the slots: weights, ranks, slices, L, S, R, I, Ob, dtype code
        self.kernel_args = (
            a,
            b,
            ranks,
            self.slices,
            L,
            len(sizes),
            self.max_rank,
            I,
            b.shape[2],
            _DTYPE_CODES.get(a.dtype, -1) if a.is_cpu else -1,
        )

    @classmethod
    def zeros(
        cls,
        max_loras: int,
        max_rank: int,
        in_features: int,
        offsets: list[int],
        sizes: list[int],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> LoRAStack:
        """Empty slots for output slices at `offsets` of widths `sizes` (what `init_lora` allocates)."""
        width = max((o + n for o, n in zip(offsets, sizes)), default=0)
        a = torch.zeros(max_loras, len(sizes) * max_rank, in_features, dtype=dtype, device=device)  # [L, S*R, I]
        b = torch.zeros(max_loras, max_rank, width, dtype=dtype, device=device)  # [L, R, Ob]
        ranks = torch.zeros(max_loras, len(sizes), dtype=torch.int32)  # [L, S]
        return cls(a, b, ranks, offsets, sizes)

    @classmethod
    def from_lists(
        cls, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor], offsets: list[int], ranks: list[list[int]]
    ) -> LoRAStack:
        """A copy of `add_lora_grouped`'s operands: `lora_a[q] [L, R, I]`, `lora_b[q] [L, O_q, R]`, ranks[slot][q]."""
        max_loras, max_rank, in_features = lora_a[0].shape
        stack = cls.zeros(
            max_loras, max_rank, in_features, offsets, [b.shape[1] for b in lora_b], lora_a[0].dtype, lora_a[0].device
        )
        for view, a in zip(stack.lora_a_views(), lora_a):
            view.copy_(a)
        for view, b in zip(stack.lora_b_views(), lora_b):
            view.copy_(b)
        stack.ranks.copy_(torch.tensor(ranks, dtype=torch.int32).reshape(max_loras, len(lora_a)))
        return stack

    def lora_a_views(self) -> list[torch.Tensor]:
        """Slice q's A as a view `[L, R, I]` into `a` (writes through)."""
        L, _, I = self.a.shape
        per = self.a.view(L, len(self.sizes), self.max_rank, I)  # [L, S, R, I]
        return [per[:, q] for q in range(len(self.sizes))]

    def lora_b_views(self) -> list[torch.Tensor]:
        """Slice q's B as a view `[L, O_q, R]` into `b` (writes through)."""
        return [self.b[:, :, o : o + n].transpose(1, 2) for o, n in zip(self.offsets, self.sizes)]

    def rank_lists(self) -> list[list[int]]:
        """`ranks` as the layers' `lora_ranks` lists (ranks[slot][q])."""
        return self.ranks.tolist()


def lora_add_cpu(
    x: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor, stack: LoRAStack, threads: int | None = None
) -> torch.Tensor:
    """`out [T, O] += ` the LoRA delta of `x [T, I]` for each token's slot (`token_slots [T]` int64 on CPU, -1:
    none), in place, in one C++ call; returns out. x and the stack share a dtype (float32 or bfloat16); out has it
    too, or is float32 (a delta buffer). x and out need unit stride along their last dim. Slots past the stack's L
    are skipped like -1. Check `lora_cpu_supported` first."""
    dtype, args = x.dtype, stack.kernel_args
    if (
        dtype is not stack.a.dtype
        or args[-1] < 0
        or (out.dtype is not dtype and out.dtype is not torch.float32)
        or not (x.is_cpu and out.is_cpu and token_slots.is_cpu)
    ):
        raise ValueError(
            f"lora_add_cpu: CPU tensors, x {dtype}, weights {stack.a.dtype} (float32 or bfloat16), "
            f"out {out.dtype} (x's or float32)"
        )
    T, I = x.shape
    xs, os_ = x.stride(), out.stride()
    if (
        xs[1] != 1
        or os_[1] != 1
        or I != args[7]
        or out.shape[0] != T
        or out.shape[1] < args[8]
        or token_slots.shape[0] != T
    ):
        raise ValueError(
            f"lora_add_cpu: x [T, {args[7]}] and out [T, >= {args[8]}] with unit column stride and "
            f"token_slots [T]; got {tuple(x.shape)}, {tuple(out.shape)}, {tuple(token_slots.shape)}"
        )
    if token_slots.dtype is not torch.int64 or not token_slots.is_contiguous():
        token_slots = token_slots.to(torch.int64).contiguous()
    if T:
        lora_cpu_kernel()(
            x, xs[0], out, os_[0], token_slots, T, *args, out.dtype is not dtype, threads or torch.get_num_threads()
        )
    return out


def lora_add_ref(x: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor, stack: LoRAStack) -> torch.Tensor:
    """`lora_add_cpu`'s contract through the torch twin (`lora_ref.add_lora_grouped`, any device)."""
    from vlserve.kernels.lora_ref import add_lora_grouped, token_groups

    add_lora_grouped(
        x, out, stack.lora_a_views(), stack.lora_b_views(), stack.offsets, stack.rank_lists(), token_groups(token_slots)
    )
    return out


def lora_add(x: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor, stack: LoRAStack) -> torch.Tensor:
    """`lora_add_cpu` where it serves these tensors, else the torch twin."""
    if x.device.type == "cpu" and lora_cpu_supported(x.dtype):
        return lora_add_cpu(x, out, token_slots, stack)
    return lora_add_ref(x, out, token_slots, stack)


def lora_add_cpu_lists(
    x: torch.Tensor,
    out: torch.Tensor,
    token_slots: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    offsets: list[int],
    ranks: list[list[int]],
    threads: int | None = None,
) -> torch.Tensor:
    """`lora_add_cpu` on `add_lora_grouped`'s operands (per-slice lists): stacks them on every call, so for tests and
    one-off use; the layers keep a `LoRAStack` instead."""
    return lora_add_cpu(x, out, token_slots, LoRAStack.from_lists(lora_a, lora_b, offsets, ranks), threads)
