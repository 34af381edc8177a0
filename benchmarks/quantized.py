"""Quantized vs unquantized serving on CPU: weight bytes, peak RSS, and tokens/s at batch 1 and 32 for a
checkpoint and its quantized copies, through vlserve and (optionally) vLLM-CPU, each case in a fresh process.

    python -m benchmarks.quantized --base DIR --quantized w4a16=DIR w8a8=DIR ... \
        [--vllm-python /root/.cache/vlserve-anchor/vllmcpu/bin/python]

Every case runs greedy with `ignore_eos` on the same random prompts; tokens/s is the fastest of `--repeats` runs
after a warm-up; peak RSS is the process's maximum resident set (`ru_maxrss`), load included. Ratios are against
the base checkpoint on the same engine, and vlserve against vLLM-CPU on the same checkpoint. With `--openvino`,
OpenVINO GenAI runs the base checkpoint's OpenVINO IR on the same prompt ids, at the run's dtype and with int8
weights (per-channel weight compression, its best quantized configuration on CPU), and every case's tokens/s is
also given against it: the base against its base IR, each quantized case against its int8 one.
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks.offline_case import run_case
from vlserve.bench.openvino_anchor import (
    OPENVINO_LABEL,
    OpenVinoCase,
    add_openvino_args,
    bench_openvino,
    ir_weight_bytes,
    openvino_python,
)
from vlserve.bench.throughput import make_prompts

ENGINE_NAMES = {"vlserve": "vlserve", "vllm": "vLLM-CPU"}
OPENVINO_ROWS = {"base": "openvino", "int8": "openvino int8 weights"}


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
    add_openvino_args(p)
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
    ov_python = openvino_python(args)
    ov_results = run_openvino_cases(ov_python, args.base, cfg, args.openvino_export_dir) if ov_python else {}
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
        for engine, _ in engines:
            r, base = results[(name, engine)], results[("base", engine)]
            print(table_row(name, engine, r, base, weight_bytes(model), base_bytes, batches))
    for name, (ir_dir, r) in ov_results.items():
        base = ov_results["base"][1]
        wb = ir_weight_bytes(ir_dir) if ir_dir else None
        print(table_row(name, OPENVINO_ROWS[name], r, base, wb, base_bytes, batches))
    if args.vllm_python:
        print("\nvlserve / vLLM-CPU tokens/s on the same checkpoint:")
        for name, _ in cases:
            print(f"  {name}: {ratios(results[(name, 'vlserve')], results[(name, 'vllm')], batches)}")
    if ov_results:
        print(f"\ntokens/s / {OPENVINO_LABEL}'s on the same base checkpoint (quantized cases / its int8 weights):")
        for name, _ in cases:
            theirs = ov_results["base" if name == "base" else "int8"][1]
            for engine, _ in engines:
                print(f"  {name} {ENGINE_NAMES[engine]}: {ratios(results[(name, engine)], theirs, batches)}")


def table_row(name: str, engine: str, r, base, wb: int | None, base_bytes: int, batches: list[int]) -> str:
    """One row of the table: weights (None: unknown), peak RSS and tok/s per batch against the same engine's base
    checkpoint."""
    weights = "-" if wb is None else f"{wb / 2**30:.2f} ({wb / base_bytes:.2f}x)"
    if isinstance(r, str):
        return f"| {name} | {engine} | {weights} | {r} |"
    cols = []
    for b in batches:
        ratio = f"{r[str(b)] / base[str(b)]:.2f}x" if isinstance(base, dict) else "-"
        cols.append(f"{r[str(b)]:.1f} | {ratio}")
    return f"| {name} | {engine} | {weights} | {r['rss_gib']:.2f} | " + " | ".join(cols) + " |"


def ratios(ours, theirs, batches: list[int]) -> str:
    """`b1 1.23x, b32 0.98x`: ours / theirs tokens/s per batch, or why there is none."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return ", ".join(f"b{b} {ours[str(b)] / theirs[str(b)]:.2f}x" for b in batches)
    return f"n/a ({theirs if isinstance(theirs, str) else ours})"


def run_openvino_cases(python: str, base: str, cfg: dict, export_dir: str) -> dict[str, tuple[str, dict | str]]:
    """OpenVINO GenAI on the base checkpoint's IR at the run's dtype ("base") and with int8 weights ("int8"), the
    same prompts, batches and threads: {name: (IR directory, {batch: tok/s, "rss_gib"} or why it failed)}."""
    out = {}
    for name, weight_format in (("base", None), ("int8", "int8")):
        cases = [OpenVinoCase(f"b{b}", cfg["prompts"][:b], [cfg["output_len"]] * b) for b in cfg["batches"]]
        r = bench_openvino(python, base, cfg["dtype"], cases, cfg["repeats"], export_dir, weight_format, cfg["threads"])
        if r is None:
            out[name] = (None, "failed: see the log above")
            continue
        rates = {str(b): r["cases"][f"b{b}"].tokens / r["cases"][f"b{b}"].seconds for b in cfg["batches"]}
        out[name] = (r["ir"], {**rates, "rss_gib": r["rss_gib"]})
        print(f"# {name} / openvino: {out[name][1]}", flush=True)
    return out


if __name__ == "__main__":
    main()
