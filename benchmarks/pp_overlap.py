"""Pipeline-parallel overlap on CPU: output throughput of PP=1, PP=2 with one batch in flight, and PP=2 with the batch
queue (two batches in flight), all in one run, with ratios against PP=1 from that run, and each stage's idle
fraction (the pipeline bubble) with one and with two batches in flight.

    python -m benchmarks.pp_overlap [--requests 16] [--prompt-len 64] [--output-len 64] [--hidden 1024] [--layers 8]

Builds one random Qwen2 checkpoint (float32; hidden 1024, 8 layers: a 16-sequence decode step takes tens of ms on one
core), then runs each configuration in a fresh process: N requests at once (greedy, EOS ignored), one warm-up
`generate`, then the median of `--rounds` timed ones; tok/s = output tokens / wall time (prefill included).

Threads (torch intra-op): each pipeline rank takes 1 thread (the engine's default on a 2-core machine, cores //
stages); PP=1 runs twice, with 1 thread (the same per-process compute as one stage: the fair baseline for "one more
core buys what?") and with 2 threads (all the machine's cores in one process). The engine process itself (scheduling,
pickling, detokenizing) shares the cores with the ranks in every configuration.

"PP=2, one batch in flight" is today's path without the batch queue: `engine.batch_queue = None` on the built engine
(a private switch only this benchmark uses), so each stage idles while the other one works.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [  # name, pipeline_parallel_size, torch threads of the PP=1 process, batch queue on
    ("PP=1, 1 thread", 1, 1, False),
    ("PP=1, 2 threads", 1, 2, False),
    ("PP=2, one batch in flight", 2, None, False),
    ("PP=2, overlap (batch queue)", 2, None, True),
]


def _child(model: str, pp: int, threads: int | None, overlap: bool, args) -> dict:
    import torch

    import vlserve
    from vlserve import LLM, SamplingParams

    assert os.path.dirname(os.path.dirname(os.path.abspath(vlserve.__file__))) == REPO, vlserve.__file__

    if threads is not None:
        torch.set_num_threads(threads)
    llm = LLM(
        model,
        dtype="float32",
        pipeline_parallel_size=pp,
        num_kv_blocks=1024,
        max_num_seqs=max(args.requests, 1),
        max_model_len=args.prompt_len + args.output_len + 16,
    )
    if pp > 1 and not overlap:
        llm.engine.batch_queue = None  # one step at a time (the path before the batch queue)
    prompts = [
        {"prompt_token_ids": [(7 * i + 13 * j) % 600 + 3 for j in range(args.prompt_len)]} for i in range(args.requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    times, tokens, idle = [], None, []
    executor = llm.engine.executor
    for _ in range(args.rounds):
        if pp > 1:
            executor.collective_rpc("stage_timing", True)  # each round's own bubble
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        if pp > 1:
            idle.append([t["idle_fraction"] for t in executor.collective_rpc("stage_timing")])
        toks = [o.outputs[0].token_ids for o in outs]
        assert tokens is None or toks == tokens
        tokens = toks
    in_flight = llm.get_metrics().get("vlserve:max_batches_in_flight", 1)
    llm.shutdown()
    n_out = sum(len(t) for t in tokens)
    wall = statistics.median(times)
    # per stage, the idle fraction of the median round (by wall time)
    median_round = sorted(range(len(times)), key=times.__getitem__)[len(times) // 2]
    stage_idle = idle[median_round] if idle else []
    return {
        "tok_s": n_out / wall,
        "wall_s": wall,
        "max_in_flight": in_flight,
        "stage_idle": stage_idle,
        "first": tokens[0][:8],
        "digest": hash(tuple(tuple(t) for t in tokens)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        model, pp, threads, overlap = json.loads(args.child)
        print("RESULT " + json.dumps(_child(model, pp, threads, overlap, args)), flush=True)
        return

    from vlserve.demo.checkpoints import build_text_checkpoint

    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        model = build_text_checkpoint(
            tmp,
            arch="qwen2",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.hidden // 64,
            num_kv_heads=max(args.hidden // 256, 1),
            intermediate_size=args.hidden * 11 // 4,
            initializer_range=0.02,
        )
        print(
            f"{cores} cores; random Qwen2 hidden {args.hidden}, {args.layers} layers, float32; {args.requests} "
            f"requests x ({args.prompt_len} prompt + {args.output_len} output tokens), median of {args.rounds}"
        )
        results = {}
        for name, pp, threads, overlap in CONFIGS:
            env = dict(os.environ)
            env.pop("OMP_NUM_THREADS", None)  # the ranks take cores // stages threads each
            env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.pp_overlap",
                "--child",
                json.dumps([model, pp, threads, overlap]),
                "--requests",
                str(args.requests),
                "--prompt-len",
                str(args.prompt_len),
                "--output-len",
                str(args.output_len),
                "--rounds",
                str(args.rounds),
            ]
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not line:
                sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
            results[name] = json.loads(line[0][len("RESULT ") :])
    base = results[CONFIGS[0][0]]["tok_s"]
    base2 = results[CONFIGS[1][0]]["tok_s"]
    print(
        f"{'configuration':<30} {'tok/s':>8} {'wall s':>7} {'vs PP=1 1t':>10} {'vs PP=1 2t':>10} {'in flight':>9} "
        f"{'stage idle (bubble)':>20}"
    )
    for name, r in results.items():
        idle = " / ".join(f"{100 * f:.0f}%" for f in r["stage_idle"]) or "-"
        print(
            f"{name:<30} {r['tok_s']:8.1f} {r['wall_s']:7.2f} {r['tok_s'] / base:10.2f} {r['tok_s'] / base2:10.2f} "
            f"{r['max_in_flight']:9d} {idle:>20}"
        )
    print(
        "stage idle: per stage, 1 - (time in steps - time blocked receiving / sending the stream) / the span from "
        "its first step to its last, in the median round"
    )
    same = len({r["digest"] for r in results.values()}) == 1
    print("greedy outputs identical across configurations:", same)


if __name__ == "__main__":
    main()
