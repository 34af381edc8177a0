"""Gemma 3's sliding-window KV cache at 8k context: blocks held and the batch that fits, KV cache groups
(sliding layers hand back blocks past their window) against the plain layout (every layer keeps every block).

    python -m benchmarks.kv_groups [--context 8192] [--output-len 256] [--budget-gib 16] [--engine]

Part 1 drives the real Scheduler and KVCacheManager (a runner that samples a fixed token: no model) with Gemma 3
4B / 12B / 27B's layer layouts (HF configs: sliding window 1024, every 6th layer full; KV heads and head_dim as
released; bf16 cache, block size 16). Both layouts get the same bytes; it prints the blocks and MiB one request holds
at the end of its prompt and at the end of its output, and the most requests running at once (without a preemption)
when 64 wait. Part 2 (`--engine`) runs a locally built small Gemma 3 (random weights, 5 sliding + 1 full layer,
window 512) through vlserve.LLM on this machine, 8 requests of `--context` tokens, both layouts in the same KV bytes
(the plain one: the same checkpoint with every layer full): the most requests running at once and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

from vlserve.config import SchedulerConfig
from vlserve.core.kv_cache_groups import group_layers
from vlserve.core.kv_cache_manager import cdiv
from vlserve.core.request import EngineCoreRequest
from vlserve.core.sched_output import ModelRunnerOutput
from vlserve.core.scheduler import Scheduler
from vlserve.sampling_params import SamplingParams

BLOCK_SIZE = 16
# name: (layers, KV heads, head_dim) of the released Gemma 3 checkpoints' text configs
GEMMA3_SHAPES = {"gemma-3-4b": (34, 4, 256), "gemma-3-12b": (48, 8, 256), "gemma-3-27b": (62, 16, 128)}
WINDOW, PATTERN = 1024, 6  # sliding_window; every PATTERN-th layer is full attention


def gemma3_windows(num_layers: int, window: int = WINDOW) -> list[int | None]:
    """Each layer's window as Gemma 3 lays them out: (PATTERN - 1) sliding layers, then a full one."""
    return [None if (i + 1) % PATTERN == 0 else window for i in range(num_layers)]


def simulate(
    windows: list[int | None],
    page_bytes: int,
    budget: int,
    context: int,
    output_len: int,
    num_requests: int = 64,
    hybrid: bool = True,
) -> dict:
    """Run `num_requests` requests of `context` prompt tokens and `output_len` outputs through the real scheduler
    in `budget` KV bytes; the layout is KV cache groups (`hybrid`) or one group of every layer."""
    groups = group_layers(windows) if hybrid else group_layers([None] * len(windows))
    bytes_per_block = groups.num_slots * page_bytes
    num_blocks = budget // bytes_per_block
    cfg = SchedulerConfig(
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=context + output_len + 1,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=False,
        kv_group_windows=groups.windows,
    )
    sched = Scheduler(cfg, num_blocks)
    rng = random.Random(0)
    for i in range(num_requests):
        prompt = [rng.randrange(1, 30000) for _ in range(context)]
        sched.add_request(
            EngineCoreRequest(f"r{i}", prompt, SamplingParams(max_tokens=output_len, ignore_eos=True), 0.0, [])
        )
    peak_running, held = 0, {}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        if sched.stats.num_preemptions == 0:
            peak_running = max(peak_running, len(sched.running))
        probe = sched.requests.get("r0")
        if probe is not None and probe.request_id in sched.kv.req_to_blocks:
            null = sched.kv.pool.null_block
            n = sum(1 for group in sched.kv.req_to_blocks["r0"] for b in group if b is not null)
            key = "prompt" if probe.num_output_tokens == 0 else "output"
            held[key] = n
        ids = list(out.num_scheduled_tokens)
        toks = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else [] for r in ids]
        sched.update_from_output(out, ModelRunnerOutput(ids, toks))
    sched.check_integrity()
    return dict(
        groups=groups.num_groups,
        slots=groups.num_slots,
        num_blocks=num_blocks,
        bytes_per_block=bytes_per_block,
        held_prompt=held.get("prompt", 0),
        held_end=held.get("output", 0),
        peak_running=peak_running,
        preemptions=sched.stats.num_preemptions,
    )


def layout_table(context: int, output_len: int, budget_gib: float) -> None:
    """Part 1: print the blocks held and the batch that fits for each released Gemma 3 shape."""
    budget = int(budget_gib * 2**30)
    print(f"# Gemma 3 KV at {context} + {output_len} tokens, {budget_gib:g} GiB of bf16 KV, block size {BLOCK_SIZE}")
    print(
        "| model | layout | groups x slots | blocks in pool | MiB per request (prompt / end) | batch that fits |"
        " ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (layers, kv_heads, head_dim) in GEMMA3_SHAPES.items():
        page = 2 * BLOCK_SIZE * kv_heads * head_dim * 2  # K and V, one layer, bf16
        windows = gemma3_windows(layers)
        rows = {}
        for hybrid in (False, True):
            r = rows[hybrid] = simulate(windows, page, budget, context, output_len, hybrid=hybrid)
            mib = lambda n: n * r["bytes_per_block"] / 2**20  # noqa: E731
            ratio = rows[True]["peak_running"] / max(rows[False]["peak_running"], 1) if hybrid else 1.0
            print(
                f"| {name} | {'KV groups' if hybrid else 'plain'} | {r['groups']} x {r['slots']} | "
                f"{r['num_blocks']} | {mib(r['held_prompt']):.0f} / {mib(r['held_end']):.0f} | "
                f"{r['peak_running']} | {ratio:.2f}x |",
                flush=True,
            )


def engine_run(context: int, budget_mib: float, num_requests: int = 8) -> None:
    """Part 2: a small Gemma 3 through vlserve.LLM, both layouts in the same KV bytes."""
    from tests.support.gemma3_checkpoints import build_gemma3_text_checkpoint
    from vlserve import LLM

    root = tempfile.mkdtemp(prefix="kvgroups_")
    types = ("sliding_attention",) * 5 + ("full_attention",)
    dirs = {}
    for label, layer_types in (("KV groups", types), ("plain", ("full_attention",) * 6)):
        d = build_gemma3_text_checkpoint(
            os.path.join(root, label.replace(" ", "_")),
            hidden_size=128,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            intermediate_size=256,
            layer_types=layer_types,
            sliding_window=512,
        )
        path = os.path.join(d, "config.json")
        cfg = json.load(open(path))
        cfg["max_position_embeddings"] = context + 64
        json.dump(cfg, open(path, "w"))
        dirs[label] = d
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(context)]} for _ in range(num_requests)]
    print(
        f"# vlserve.LLM, small Gemma 3 (6 layers, window 512), {num_requests} x {context} tokens + 16, "
        f"{budget_mib:g} MiB KV, float32"
    )
    print("| layout | blocks | most running at once | preemptions | wall s |")
    print("|---|---|---|---|---|")
    for label, d in dirs.items():
        llm = LLM(
            d,
            dtype="float32",
            kv_cache_memory_bytes=int(budget_mib * 2**20),
            max_num_batched_tokens=2048,
            max_model_len=context + 32,
        )
        sched = llm.engine.scheduler
        peak = [0]
        schedule = sched.schedule

        def counting_schedule():
            out = schedule()
            peak[0] = max(peak[0], len(sched.running))
            return out

        sched.schedule = counting_schedule
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
        wall = time.perf_counter() - t0
        print(
            f"| {label} | {sched.kv.num_blocks} | {peak[0]} | {sched.stats.num_preemptions} | {wall:.1f} |", flush=True
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--budget-gib", type=float, default=16.0)
    p.add_argument("--engine", action="store_true", help="also run part 2 (a small model through vlserve.LLM)")
    p.add_argument(
        "--engine-budget-mib",
        type=float,
        default=None,
        help="part 2's KV bytes (default: two plain-layout requests' worth)",
    )
    args = p.parse_args(argv)
    layout_table(args.context, args.output_len, args.budget_gib)
    if args.engine:
        plain_request = 2 * 6 * cdiv(args.context + 32, BLOCK_SIZE) * BLOCK_SIZE * 2 * 32 * 4  # K+V, fp32
        engine_run(args.context, args.engine_budget_mib or 2 * plain_request / 2**20)


if __name__ == "__main__":
    main()
