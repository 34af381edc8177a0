"""LoRA at decode shapes on CPU: the torch twin (`lora_ref.add_lora_grouped`, grouped by slot, a shrink and an
expand matmul per slot and slice) against the fused C++ kernel (`kernels.lora_cpu.lora_add_cpu`, one call a layer),
per projection and for a whole decoder layer's linears.

A decoder layer here is Qwen2's four projections on the packed CPU linear: qkv_proj (slices q, k, v: H, 256, 256),
o_proj (H), gate_up_proj (gate, up: 3H each, through `cpu_linear_silu_mul`) and down_proj (H): the 7 LoRA slices.
T = 32 decode rows whose slots cycle through 4 adapters (row i: slot i % 4, as the LoRA bench's requests do), every
adapter of rank `--rank` on every slice. Per layer it times:

- base: the four packed linears alone (no LoRA);
- twin: base + the twin's delta on qkv/o/down, and the MLP as `GatedMLPWithLoRA` runs it today (fused SiLU kernel
  on all rows, then gate_up recomputed unfused with its delta for each slot's rows);
- kernel: base + `lora_add_cpu` on qkv/o/down, and the MLP as one `lora_add_cpu` into a zeroed float32 [T, 2I]
  buffer plus `cpu_linear_silu_mul(..., pre_act_add=delta)`.

The variants alternate call by call (drift hits all alike); medians in microseconds over `--reps` calls.
`base / twin` and `base / kernel` are the layer-linears' throughput ratios (the issue's goal: >= 0.8 end to end).

    python -m benchmarks.lora_cpu [--reps 200] [--hidden 512 2048] [--rank 8 16] [--dtype float32] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from vlserve.kernels.cpu_linear import cpu_linear, cpu_linear_silu_mul, pack_linear_weight
from vlserve.kernels.lora_cpu import LoRAStack, lora_add_cpu, lora_cpu_kernel
from vlserve.kernels.lora_ref import add_lora_grouped, take_rows, token_groups

SLOTS, KV = 4, 256  # adapters in the batch; k and v widths (2 KV heads of 128)


class Proj:
    """One projection: packed base weight [O, I] and its LoRA slots (lists for the twin, a stack for the kernel)."""

    def __init__(self, in_features: int, sizes: list[int], rank: int, dtype: torch.dtype, g: torch.Generator):
        out = sum(sizes)
        self.out, self.sizes = out, sizes
        self.offsets = [sum(sizes[:q]) for q in range(len(sizes))]
        self.w = (torch.randn(out, in_features, generator=g) / in_features**0.5).to(dtype)  # [O, I]
        self.packed = pack_linear_weight(self.w)
        self.lora_a = [
            (torch.randn(SLOTS, rank, in_features, generator=g) / in_features**0.5).to(dtype) for _ in sizes
        ]  # each [L, R, I]
        self.lora_b = [(torch.randn(SLOTS, n, rank, generator=g) * 0.1).to(dtype) for n in sizes]  # [L, O_s, R]
        self.ranks = [[rank] * len(sizes) for _ in range(SLOTS)]
        self.stack = LoRAStack.from_lists(self.lora_a, self.lora_b, self.offsets, self.ranks)

    def twin(self, x, out, groups):
        add_lora_grouped(x, out, self.lora_a, self.lora_b, self.offsets, self.ranks, groups)
        return out


def layer(hidden: int, rank: int, dtype: torch.dtype, g: torch.Generator) -> dict[str, Proj]:
    inter = 3 * hidden
    return {
        "qkv": Proj(hidden, [hidden, KV, KV], rank, dtype, g),
        "o": Proj(hidden, [hidden], rank, dtype, g),
        "gate_up": Proj(hidden, [inter, inter], rank, dtype, g),
        "down": Proj(inter, [hidden], rank, dtype, g),
    }


def run_layer(p: dict[str, Proj], x: torch.Tensor, slots: torch.Tensor, groups, mode: str) -> torch.Tensor:
    """One layer's linears on x [T, H] in `mode` ("base", "twin", "kernel"); attention is skipped (o_proj and the
    MLP take qkv's first H columns as their input)."""

    def lin(name, inp):
        out = cpu_linear(inp, p[name].packed, None, p[name].out)  # [T, O]
        if mode == "twin":
            return p[name].twin(inp, out, groups)
        return lora_add_cpu(inp, out, slots, p[name].stack) if mode == "kernel" else out

    h = lin("qkv", x)[:, : x.shape[1]].contiguous()  # [T, H]
    h = lin("o", h)
    gu, inter = p["gate_up"], p["gate_up"].sizes[0]
    if mode == "kernel":
        delta = lora_add_cpu(h, torch.zeros(h.shape[0], 2 * inter), slots, gu.stack)  # [T, 2I] float32
        act = cpu_linear_silu_mul(h, gu.packed, None, inter, delta)  # [T, I]
    else:
        act = cpu_linear_silu_mul(h, gu.packed, None, inter)  # [T, I]
        for slot, rows in groups if mode == "twin" else ():  # today's GatedMLPWithLoRA: recompute adapter rows
            hs = take_rows(h, rows)  # [n, H]
            gate_up = cpu_linear(hs, gu.packed, None, 2 * inter)  # [n, 2I]
            add_lora_grouped(hs, gate_up, gu.lora_a, gu.lora_b, gu.offsets, gu.ranks, ((slot, slice(0, len(hs))),))
            rows_act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            if isinstance(rows, slice):
                act[rows] = rows_act
            else:
                act.index_copy_(0, rows, rows_act)
    return lin("down", act)


def median_us(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2] * 1e6


def timed(fns: dict, reps: int) -> dict[str, float]:
    """Median microseconds of each callable, calls interleaved."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    samples = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            samples[k].append(time.perf_counter() - t)
    return {k: median_us(v) for k, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rank", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if lora_cpu_kernel() is None:
        sys.exit("the C++ LoRA kernel cannot be built here")
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    slots = torch.arange(args.tokens) % SLOTS  # [T]
    groups = token_groups(slots)  # once per step, as lora_step does
    print(f"T={args.tokens}, {SLOTS} adapters, {args.dtype}, threads {torch.get_num_threads()}; medians in us")
    print(f"{'hidden':>6} {'rank':>4} | {'proj':>7} {'twin':>8} {'kernel':>8} {'speedup':>7}")
    rows = []
    for hidden in args.hidden:
        for rank in args.rank:
            p = layer(hidden, rank, dtype, g)
            x = torch.randn(args.tokens, hidden, generator=g).to(dtype)
            h = torch.randn(args.tokens, 3 * hidden, generator=g).to(dtype)
            for name, proj in p.items():
                inp = h if name == "down" else x
                out = torch.zeros(args.tokens, proj.out, dtype=dtype)
                t = timed(
                    {
                        "twin": lambda: proj.twin(inp, out, groups),
                        "kernel": lambda: lora_add_cpu(inp, out, slots, proj.stack),
                    },
                    args.reps,
                )
                print(
                    f"{hidden:>6} {rank:>4} | {name:>7} {t['twin']:>8.1f} {t['kernel']:>8.1f} "
                    f"{t['twin'] / t['kernel']:>6.1f}x"
                )
            t = timed(
                {m: (lambda m=m: run_layer(p, x, slots, groups, m)) for m in ("base", "twin", "kernel")}, args.reps
            )
            rows.append((hidden, rank, t))
    print("\nper layer (4 projections, the MLP's gate_up fused):")
    print(f"{'hidden':>6} {'rank':>4} | {'base':>8} {'twin':>8} {'kernel':>8} | {'base/twin':>9} {'base/kernel':>11}")
    for hidden, rank, t in rows:
        print(
            f"{hidden:>6} {rank:>4} | {t['base']:>8.1f} {t['twin']:>8.1f} {t['kernel']:>8.1f} | "
            f"{t['base'] / t['twin']:>8.2f}x {t['base'] / t['kernel']:>10.2f}x"
        )


if __name__ == "__main__":
    main()
