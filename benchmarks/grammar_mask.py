"""Structured outputs' bitmask pass on CPU: the numpy unpack + `masked_fill_` path (the runner's before the
C++ pass, kept as the reference) against the C++ pass (`kernels.grammar_mask`), both masking every row of float32
logits in place (as the runner does when every request is constrained).

Shapes: a real vocabulary (151,936 tokens, Qwen2's) at 32 rows and at 1 row, and the test tokenizer's 689 tokens at
32 rows. Masks: "few" allows ~0.5% of the tokens at random places (a JSON string's start: the tokens that begin with
a quote are few and scattered), "most" forbids ~1% (inside a string: the tokens with a quote or a backslash), "random"
sets each bit with probability 1/2. The two paths alternate call by call, so the machine's drift hits both alike;
medians in microseconds over `--reps` calls each. Masking is idempotent, so repeated calls do the same work.

    python -m benchmarks.grammar_mask [--reps 200] [--dtype float32]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from vlserve.kernels.grammar_mask import apply_token_bitmask_cpu, apply_token_bitmask_ref, grammar_mask_kernel

SHAPES = [(151936, 32), (151936, 1), (689, 32)]  # (vocab, rows)
KINDS = {"few": 0.005, "most": 0.99, "random": 0.5}  # fraction of tokens allowed


def make_mask(rows: int, vocab: int, allowed: float, rng: np.random.Generator) -> np.ndarray:
    """int32 [rows, ceil(vocab / 32)]: each token allowed with probability `allowed`, bits past vocab clear."""
    words = (vocab + 31) // 32
    bits = np.zeros((rows, 32 * words), dtype=np.uint8)  # [rows, 32 W]
    bits[:, :vocab] = rng.random((rows, vocab)) < allowed
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)  # [rows, W]


def median_us(samples: list[float]) -> float:
    return float(np.median(samples)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200, help="calls per path and case")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    if grammar_mask_kernel() is None:
        sys.exit("the C++ pass could not be built here")
    dtype = getattr(torch, args.dtype)
    rng = np.random.default_rng(0)
    print(f"{args.dtype} logits, {torch.get_num_threads()} threads, median of {args.reps} calls each (us)")
    print("| vocab | rows | mask | numpy + masked_fill_ (us) | C++ pass (us) | ratio |")
    print("|---|---|---|---|---|---|")
    for vocab, rows in SHAPES:
        for kind, allowed in KINDS.items():
            mask = make_mask(rows, vocab, allowed, rng)
            logits = torch.randn(rows, vocab).to(dtype)  # [rows, vocab]
            want = logits.clone()
            apply_token_bitmask_ref(want, mask)
            apply_token_bitmask_cpu(logits, mask)
            assert torch.equal(logits, want), "the two paths disagree"
            paths = {
                "old": lambda: apply_token_bitmask_ref(logits, mask),
                "new": lambda: apply_token_bitmask_cpu(logits, mask),
            }
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(3):  # warm-up
                for fn in paths.values():
                    fn()
            for _ in range(args.reps):
                for name, fn in paths.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            old, new = median_us(times["old"]), median_us(times["new"])
            print(f"| {vocab:,} | {rows} | {kind} | {old:.1f} | {new:.1f} | {old / new:.1f}x |")


if __name__ == "__main__":
    main()
