"""Quantized vs unquantized serving on CPU: weight bytes, peak RSS, and tokens/s at batch 1 and 32 for a
checkpoint and its quantized copies, through vlserve and (optionally) vLLM-CPU, each case in a fresh process.

    python -m benchmarks.quantized --base DIR --quantized w4a16=DIR w8a8=DIR ... \
        [--vllm-python /root/.cache/vlserve-anchor/vllmcpu/bin/python]

Every case runs greedy with `ignore_eos` on the same random prompts; tokens/s is the fastest of `--repeats` runs
after a warm-up; peak RSS is the process's maximum resident set (`ru_maxrss`), load included. Ratios are against
the base checkpoint on the same engine, and vlserve against vLLM-CPU on the same checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks.offline_case import run_case
from vlserve.bench.throughput import make_prompts


def weight_bytes(model_dir: str) -> int:
    """Bytes of the checkpoint's safetensors files."""
    return sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir) if f.endswith(".safetensors"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the unquantized checkpoint")
    p.add_argument("--quantized", nargs="+", default=[], metavar="NAME=DIR", help="its quantized copies")
    p.add_argument("--dtype", default="bfloat16", help="activation / unquantized-weight dtype of every case")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--vllm-python", default=None, help="python of a venv with vLLM-CPU (skipped without)")
    p.add_argument(
        "-O",
        "--compilation-level",
        type=int,
        choices=range(4),
        default=None,
        help="vlserve's -O level (default: its CPU default, eager; vLLM-CPU runs its own default, which compiles)",
    )
    args = p.parse_args(argv)
    import torch

    batches = [int(b) for b in args.batches.split(",")]
    cases = [("base", args.base)] + [tuple(q.split("=", 1)) for q in args.quantized]
    cfg = {
        "dtype": args.dtype,
        "batches": batches,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "prompts": make_prompts(max(batches), args.input_len, 600, 0),
        "max_model_len": args.input_len + args.output_len + 16,
        "threads": args.threads or torch.get_num_threads(),
        "compilation_level": args.compilation_level,
    }
    engines = [("vlserve", sys.executable)] + ([("vllm", args.vllm_python)] if args.vllm_python else [])
    results: dict[tuple[str, str], dict | str] = {}
    for name, model in cases:
        for engine, python in engines:
            results[(name, engine)] = run_case(python, engine, model, cfg)
            print(f"# {name} / {engine}: {results[(name, engine)]}", flush=True)
    base_bytes = weight_bytes(args.base)
    level = "default" if args.compilation_level is None else f"-O{args.compilation_level}"
    print(
        f"\n{args.dtype}, {cfg['threads']} threads, {args.input_len} in -> {args.output_len} out, greedy, "
        f"vlserve {level}"
    )
    head = " | ".join(f"tok/s b{b} | vs base" for b in batches)
    print(f"| checkpoint | engine | weights GiB (vs base) | peak RSS GiB | {head} |")
    print("|" + "---|" * (4 + 2 * len(batches)))
    for name, model in cases:
        wb = weight_bytes(model)
        for engine, _ in engines:
            r, base = results[(name, engine)], results[("base", engine)]
            if isinstance(r, str):
                print(f"| {name} | {engine} | {wb / 2**30:.2f} ({wb / base_bytes:.2f}x) | {r} |")
                continue
            cols = []
            for b in batches:
                ratio = f"{r[str(b)] / base[str(b)]:.2f}x" if isinstance(base, dict) else "-"
                cols.append(f"{r[str(b)]:.1f} | {ratio}")
            print(
                f"| {name} | {engine} | {wb / 2**30:.2f} ({wb / base_bytes:.2f}x) | {r['rss_gib']:.2f} | "
                + " | ".join(cols)
                + " |"
            )
    if args.vllm_python:
        print("\nvlserve / vLLM-CPU tokens/s on the same checkpoint:")
        for name, _ in cases:
            ours, theirs = results[(name, "vlserve")], results[(name, "vllm")]
            if isinstance(ours, dict) and isinstance(theirs, dict):
                print(f"  {name}: " + ", ".join(f"b{b} {ours[str(b)] / theirs[str(b)]:.2f}x" for b in batches))
            else:
                print(f"  {name}: n/a ({theirs if isinstance(theirs, str) else ours})")


if __name__ == "__main__":
    main()
