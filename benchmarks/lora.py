"""LoRA throughput: a batch mixing 4 adapters vs the base alone, and vs vLLM-CPU with the same adapters.

    python -m benchmarks.lora [--model DIR] [--vllm-python PY] [--num-prompts 32] [--rank 8]

Builds (unless --model) a random Qwen2 (hidden 512 x 8 layers) and 4 PEFT adapters of `--rank` on all seven
projections (peft, random A and B), then per engine, each in its own process, greedy with `ignore_eos`: the base
model on an engine without LoRA, the base on the LoRA engine, and the batch whose prompts cycle through the 4
adapters (max_loras 4). Tokens/s is the fastest of `--repeats` runs after a warm-up; ratios compare the same run.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from benchmarks.offline_case import add_case_args, case_setup, run_engines

_CASE = r"""
import json, sys, time
if __name__ == "__main__":  # vLLM spawns its engine core: the script must be importable
    cfg = json.loads(sys.argv[1])
    if cfg["engine"] == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
        def make(lora):
            kw = dict(enable_lora=True, max_loras=4, max_lora_rank=cfg["rank"]) if lora else {}
            return LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"], seed=0, **kw)
    else:
        from vlserve import LLM, LoRARequest, SamplingParams
        def make(lora):
            kw = dict(enable_lora=True, max_loras=4, max_lora_rank=cfg["rank"]) if lora else {}
            return LLM(cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"], **kw)
    prompts = [{"prompt_token_ids": p} for p in cfg["prompts"]]
    sp = SamplingParams(temperature=0.0, max_tokens=cfg["output_len"], ignore_eos=True)
    adapters = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(cfg["adapters"])]
    mixed = [adapters[i % len(adapters)] for i in range(len(prompts))]
    def tok_s(llm, lora):
        llm.generate(prompts[:4], sp, use_tqdm=False, **({"lora_request": mixed[:4]} if lora else {}))
        best = float("inf")
        for _ in range(cfg["repeats"]):
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False, **({"lora_request": mixed} if lora else {}))
            best = min(best, time.perf_counter() - t)
        return sum(len(o.outputs[0].token_ids) for o in outs) / best, [list(o.outputs[0].token_ids) for o in outs]
    result = {}
    result["base"], _ = tok_s(make(False), False)
    llm = make(True)
    result["base_on_lora_engine"], _ = tok_s(llm, False)
    result["mixed"], result["mixed_tokens"] = tok_s(llm, True)
    print("CASE_CORES " + json.dumps(engine_cores()))
    print("CASE_RESULT " + json.dumps(result))
"""


def build_adapters(model: str, out_dir: str, rank: int, n: int = 4) -> list[str]:
    """`n` random PEFT LoRA adapters of `rank` on all seven projections of `model` (A and B random)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(n):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        cfg = LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        )
        path = os.path.join(out_dir, f"adapter{i}")
        get_peft_model(base, cfg).save_pretrained(path)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_args(p, num_prompts=32, input_len=64, output_len=64)
    p.add_argument("--rank", type=int, default=8)
    args = p.parse_args(argv)
    model, cfg = case_setup(args)
    cfg.update(rank=args.rank, adapters=build_adapters(model, tempfile.mkdtemp(prefix="vlserve-lora-"), args.rank))
    results = run_engines(_CASE, model, cfg, args.vllm_python)
    print(
        f"# {args.num_prompts} prompts x {args.input_len} tokens, {args.output_len} new, 4 adapters of rank "
        f"{args.rank} on all projections, {args.dtype}, model {model}"
    )
    print("| engine | base, no LoRA (tok/s) | base on the LoRA engine | 4 adapters mixed | mixed / base |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        if isinstance(r, str):
            print(f"| {name} | {r} | | | |")
            continue
        print(
            f"| {name} | {r['base']:.1f} | {r['base_on_lora_engine']:.1f} | {r['mixed']:.1f} | "
            f"{r['mixed'] / r['base']:.2f}x |"
        )
    ours, theirs = results["vlserve"], results.get("vllm")
    if isinstance(ours, dict) and isinstance(theirs, dict):
        same = sum(a == b for a, b in zip(ours["mixed_tokens"], theirs["mixed_tokens"]))
        print(
            f"mixed batch: vlserve / vLLM-CPU tok/s = {ours['mixed'] / theirs['mixed']:.2f}x; outputs equal on "
            f"{same} of {len(ours['mixed_tokens'])} prompts"
        )


if __name__ == "__main__":
    main()
