"""Host work per engine step at a large batch: ms/step and where it goes, on a model too small to matter.

    OMP_NUM_THREADS=1 python -m benchmarks.host_step --num-prompts 256 --repeats 3 --profile

A tiny random Qwen2 (hidden 64, 2 layers) makes the forward nearly free, so ms/step is the engine's own Python:
scheduling, KV slot allocation, input preparation, output folding and detokenizing. Each repeat runs
`LLM.generate` over N prompts (greedy, ignore_eos, seeded output lengths) and prints ms/step; the breakdown times
the main components by wrapping them (a small overhead per call) and, with `--profile`, cProfile's top functions.

    OMP_NUM_THREADS=1 python -m benchmarks.host_step --null-model --output-len-range 64 64 --batches 1,64,256

`--null-model` leaves no model work at all (null_model.py: the forward and the logits return preset tensors, the
next token being the last one plus 1) and prints one table of wall and CPU ms/step per batch size, synchronous and
with async scheduling, with the time inside the null model's own calls, the engine's share (wall less that) and
whether every output was the null model's; `--profile` then prints cProfile's top
functions at the largest batch of each mode.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from collections import defaultdict

from vlserve.bench.throughput import make_prompts, random_lengths


def _wrap(obj, name: str, label: str, totals: dict[str, float]) -> None:
    """Replace obj.name by a wrapper that adds its wall time to totals[label]."""
    fn = getattr(obj, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - t

    setattr(obj, name, timed)


def component_breakdown(llm, prompts, params) -> tuple[dict[str, float], int]:
    """Seconds per component over one generate run (wrapped instance attributes, removed afterwards)."""
    core, loop = llm.engine, llm.engine_loop
    totals: dict[str, float] = defaultdict(float)
    targets = [
        (core.scheduler, "schedule", "scheduler.schedule"),
        (core.scheduler.kv, "allocate_slots", "  kv.allocate_slots"),
        (core.scheduler, "update_from_output", "scheduler.update_from_output"),
        (core.runner, "submit_step", "runner.submit_step"),
        (core.runner, "forward", "  runner.forward (model)"),
        (core.runner.step_sampler, "sample", "  runner sampling"),
        (loop.output_processor, "process_outputs", "output_processor.process_outputs"),
    ]
    saved = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in targets]
    for obj, name, label in targets:
        _wrap(obj, name, label, totals)
    try:
        steps0 = core.num_steps
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        totals["total (generate)"] = time.perf_counter() - t
        return dict(totals), core.num_steps - steps0
    finally:
        for obj, name, original in saved:  # the instance's own attribute back, or the class's
            if original is None:
                del obj.__dict__[name]
            else:
                setattr(obj, name, original)


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, build the tiny model, print ms/step per repeat and the breakdown."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len-range", type=int, nargs=2, default=[48, 64])
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        help="GiB of host KV tier (the offloading connector on: its keys and stores in every step)",
    )
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top functions (one run)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--null-model",
        action="store_true",
        help="the forward and logits return preset tensors (null_model.py): a table of ms/step per batch and mode",
    )
    ap.add_argument("--batches", default="1,64,256", help="with --null-model: the batch sizes of the table")
    args = ap.parse_args(argv)
    if args.null_model:
        null_table(args)
        return

    import torch

    from vlserve import LLM, SamplingParams
    from vlserve.demo.checkpoints import build_text_checkpoint

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with tempfile.TemporaryDirectory(prefix="vlserve-host-step-") as tmp:
        path = build_text_checkpoint(tmp, hidden_size=args.hidden_size, num_layers=args.num_layers)
        llm = LLM(
            path,
            dtype="float32",
            max_num_seqs=args.num_prompts,
            max_model_len=args.input_len + args.output_len_range[1] + 16,
            async_scheduling=args.async_scheduling,
            **({} if args.kv_offloading_size is None else {"kv_offloading_size": args.kv_offloading_size}),
        )
        vocab = llm.engine.loaded.hf_config.vocab_size
        prompts = [{"prompt_token_ids": p} for p in make_prompts(args.num_prompts, args.input_len, vocab, seed=0)]
        lens = random_lengths(args.output_len_range, args.num_prompts, seed=1)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up (compiles, fills caches)
        print(
            f"host_step: {args.num_prompts} prompts x {args.input_len} in, {args.output_len_range} out, "
            f"hidden {args.hidden_size}, {args.num_layers} layers, threads {torch.get_num_threads()}, "
            f"load average {os.getloadavg()[0]:.2f}"
        )
        per_step, cpu_per_step = [], []
        for r in range(args.repeats):
            steps0 = llm.engine.num_steps
            t, c = time.perf_counter(), time.process_time()
            llm.generate(prompts, params, use_tqdm=False)
            dt, dc = time.perf_counter() - t, time.process_time() - c
            steps = llm.engine.num_steps - steps0
            per_step.append(1e3 * dt / steps)
            cpu_per_step.append(1e3 * dc / steps)
            print(
                f"  run {r}: {steps} steps, {dt:.3f} s, {per_step[-1]:.2f} ms/step wall, "
                f"{cpu_per_step[-1]:.2f} ms/step CPU, load average {os.getloadavg()[0]:.2f}"
            )
        # CPU time is the steadier figure on a shared machine: waiting for a core does not count in it.
        print(
            f"ms/step: wall median {statistics.median(per_step):.2f} (best {min(per_step):.2f}), "
            f"CPU median {statistics.median(cpu_per_step):.2f} (best {min(cpu_per_step):.2f})"
        )
        totals, steps = component_breakdown(llm, prompts, params)
        print(f"breakdown over {steps} steps (ms/step, wrapped):")
        for label, sec in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"  {label:<40s} {1e3 * sec / steps:8.3f}")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            llm.generate(prompts, params, use_tqdm=False)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


def _timed_runs(llm, prompts, params, repeats: int, null=None) -> tuple[list[float], list[float], list[float], int]:
    """ms/step (wall, CPU, and inside the null model when `null` is its forward) per repeat of `generate`, and the
    steps of the last run."""
    from benchmarks.null_model import null_model_seconds

    walls, cpus, nulls, steps = [], [], [], 0
    for _ in range(repeats):
        steps0 = llm.engine.num_steps
        n0 = null_model_seconds(null) if null is not None else 0.0
        t, c = time.perf_counter(), time.process_time()
        llm.generate(prompts, params, use_tqdm=False)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        steps = llm.engine.num_steps - steps0
        walls.append(1e3 * dt / steps)
        cpus.append(1e3 * dc / steps)
        nulls.append(1e3 * (null_model_seconds(null) - n0) / steps if null is not None else 0.0)
    return walls, cpus, nulls, steps


def null_table(args) -> None:
    """ms/step of the engine around the null model, per batch size, synchronous and async scheduling: one table
    (median of the repeats; CPU time is the steadier figure on a shared machine)."""
    import torch

    from benchmarks.null_model import expected_tokens, install_null_model
    from vlserve import LLM, SamplingParams
    from vlserve.demo.checkpoints import build_text_checkpoint

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    batches = [int(b) for b in args.batches.split(",")]
    lo, hi = args.output_len_range
    rows = []
    with tempfile.TemporaryDirectory(prefix="vlserve-host-step-") as tmp:
        path = build_text_checkpoint(tmp, hidden_size=args.hidden_size, num_layers=args.num_layers)
        for mode in ("sync", "async"):
            llm = LLM(
                path,
                dtype="float32",
                max_num_seqs=max(batches),
                max_model_len=args.input_len + hi + 16,
                async_scheduling=mode == "async",
                enforce_eager=True,
            )
            null = install_null_model(llm)
            vocab = llm.engine.loaded.hf_config.vocab_size
            for batch in batches:
                ids = make_prompts(batch, args.input_len, vocab, seed=0)
                prompts = [{"prompt_token_ids": p} for p in ids]
                lens = random_lengths([lo, hi], batch, seed=1)
                params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
                outs = llm.generate(prompts, params, use_tqdm=False)  # warm-up, and the outputs' check
                ok = all(
                    list(o.outputs[0].token_ids) == expected_tokens(p, n, vocab) for o, p, n in zip(outs, ids, lens)
                )
                walls, cpus, nulls, steps = _timed_runs(llm, prompts, params, args.repeats, null)
                rows.append(
                    (
                        mode,
                        batch,
                        steps,
                        statistics.median(walls),
                        statistics.median(cpus),
                        statistics.median(nulls),
                        ok,
                    )
                )
                if args.profile and batch == max(batches):
                    prof = cProfile.Profile()
                    prof.enable()
                    llm.generate(prompts, params, use_tqdm=False)
                    prof.disable()
                    print(f"cProfile, {mode}, batch {batch}:")
                    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
            assert null.num_calls > 0, "the null forward was not called"
            del llm
    print(
        f"host_step --null-model: {args.input_len} in, {[lo, hi]} out, {args.repeats} repeats (median), "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print("(null model: ms/step inside the null forward and logits, copying preset rows; engine: wall less that)")
    print(
        f"{'mode':<6s} {'batch':>5s} {'steps':>5s} {'wall ms/step':>12s} {'CPU ms/step':>11s} {'null model':>10s} "
        f"{'engine':>7s} {'outputs':>7s}"
    )
    for mode, batch, steps, wall, cpu, null_ms, ok in rows:
        print(
            f"{mode:<6s} {batch:5d} {steps:5d} {wall:12.3f} {cpu:11.3f} {null_ms:10.3f} {wall - null_ms:7.3f} "
            f"{'ok' if ok else 'WRONG':>7s}"
        )


if __name__ == "__main__":
    main()
