"""Per-step overhead before and after: this checkout against an older revision, on models too small to matter.

    python -m benchmarks.step_overhead --baseline-rev 2840b99 --rounds 3

Two workloads whose time is the engine's own work, not FLOPs:
- `demo`: the shipped demo model (3.9M parameters), one stream, a 32-token prompt, 128 tokens out;
- `host`: 256 requests at once on a random Qwen2 of hidden 64 and 2 layers, 16-token prompts, 48 tokens out.
Each round runs every workload once per code version, each in a fresh process (the versions alternate, the
baseline first), on the same checkpoints: the demo model of this checkout and one random checkpoint built here.
`--async-scheduling` runs both versions with `async_scheduling=True`; `--versus-sync` adds this checkout without it
in every round (a third column, and synchronous / async).
A process warms up, times `generate` several times and reports its median: ms per output token for `demo`, wall
time / 48 (ms per decode position, the prefill included) for `host`. The baseline's code comes from
`git archive REV` and runs with this checkout's Python; both use only the public `LLM` API and the engine's
defaults (eager on CPU). The table prints the median over rounds and baseline / this checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = ("demo", "host")


# What a measured process runs (`python -c CHILD WORKLOAD MODEL ASYNC`, in the tree of the version it measures, so
# that tree's vlserve is the one imported): the workload's median over timed runs, printed as a RESULT line.
CHILD = """
import json, os, statistics, sys, time

import torch

import vlserve
from vlserve import LLM, SamplingParams

workload, model, async_scheduling = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if workload == "demo":
    llm = LLM(model, max_num_seqs=1, async_scheduling=async_scheduling)
    prompts = [{"prompt_token_ids": list(range(100, 132))}]
    out_len, timed = 128, 7
else:
    llm = LLM(model, max_num_seqs=256, max_model_len=256, num_kv_blocks=2048, async_scheduling=async_scheduling)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 200, (16,), generator=g).tolist()} for _ in range(256)]
    out_len, timed = 48, 5
params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
for _ in range(2):
    llm.generate(prompts, params, use_tqdm=False)
times = []
for _ in range(timed):
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    times.append(1000 * (time.perf_counter() - t) / out_len)
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
if tokens != out_len * len(prompts):
    raise RuntimeError(f"{workload}: {tokens} tokens out, expected {out_len * len(prompts)}")
print("RESULT " + json.dumps({"ms": statistics.median(times), "runs": [round(x, 3) for x in times],
                              "package": os.path.dirname(vlserve.__file__)}), flush=True)
"""


def _measure(src: str, workload: str, model: str, async_scheduling: bool = False) -> dict:
    """One fresh process running `workload` with the vlserve package of `src` first on its path."""
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-c", CHILD, workload, model, "1" if async_scheduling else "0"]
    proc = subprocess.run(cmd, env=env, cwd=src, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{workload} from {src} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    if os.path.realpath(result["package"]) != os.path.realpath(os.path.join(src, "vlserve")):
        raise RuntimeError(f"{workload}: imported vlserve from {result['package']}, not from {src}")
    return result


def _export(rev: str, dest: str) -> None:
    """The tree of `rev` (any git revision of this checkout) unpacked into dest."""
    archive = subprocess.run(["git", "-C", REPO, "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--baseline-rev",
        default="2840b99",
        help="git revision to compare with (default: main before the step-loop work)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: demo, host")
    p.add_argument("--async-scheduling", action="store_true", help="both versions plan step N+1 while N runs")
    p.add_argument("--versus-sync", action="store_true", help="also this checkout without async scheduling")
    args = p.parse_args(argv)
    from vlserve.demo import default_model_path
    from vlserve.demo.checkpoints import build_text_checkpoint

    workloads = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    with tempfile.TemporaryDirectory(prefix="vlserve-step-overhead-") as tmp:
        base_src = os.path.join(tmp, "baseline")
        os.makedirs(base_src)
        _export(args.baseline_rev, base_src)
        tiny = os.path.join(tmp, "tiny-qwen2")
        build_text_checkpoint(tiny, arch="qwen2", hidden_size=64, num_layers=2)
        models = {"demo": default_model_path(), "host": tiny}
        results: dict[tuple[str, str], list[float]] = {}
        for rnd in range(args.rounds):
            for w in workloads:
                runs = [("baseline", base_src, args.async_scheduling), ("current", REPO, args.async_scheduling)]
                if args.versus_sync:
                    runs.append(("sync", REPO, False))
                for name, src, use_async in runs:
                    r = _measure(src, w, models[w], use_async)
                    results.setdefault((w, name), []).append(r["ms"])
                    print(f"round {rnd + 1} {w:4s} {name:8s} {r['ms']:7.3f} ms  runs {r['runs']}", flush=True)
    head = subprocess.run(
        ["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"\nbaseline {args.baseline_rev} vs current {head}, median of {args.rounds} rounds (each a process's "
        f"median){', async scheduling' if args.async_scheduling else ''}; demo: ms/token, host: ms per decode "
        f"position"
    )
    extra = f" {'sync':>10s} {'sync/current':>13s}" if args.versus_sync else ""
    print(f"{'workload':8s} {'baseline':>10s} {'current':>10s} {'baseline/current':>17s}{extra}")
    for w in workloads:
        b, c = statistics.median(results[(w, "baseline")]), statistics.median(results[(w, "current")])
        row = f"{w:8s} {b:10.3f} {c:10.3f} {b / c:16.2f}x"
        if args.versus_sync:
            y = statistics.median(results[(w, "sync")])
            row += f" {y:10.3f} {y / c:12.2f}x"
        print(row)


if __name__ == "__main__":
    main()
