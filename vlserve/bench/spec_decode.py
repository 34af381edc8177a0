"""Speculative vs plain decoding in one run, at batch 1 and batch 16.

    python -m vlserve.bench.spec_decode --hidden-size 512 --num-layers 8
    python -m vlserve.bench.spec_decode --model TARGET --method eagle --draft DRAFT_DIR   (or --method eagle3)

With --method eagle and no --draft, a head copied from the target's last layer is built (init "mimic" of
vlserve.spec_decode.eagle_heads): it shows the machinery, not what a trained head (python -m training.train_eagle) gets.

Copy-heavy prompts (a random span repeated), greedy, ignore_eos. Prints decode tokens/s for both, the speedup,
the acceptance rate and the mean accepted length (accepted drafts per verification step + 1).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def copy_heavy_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 1, (24,), generator=g).tolist() * 4 for _ in range(n)]


def spec_stats(before: dict, after: dict) -> dict:
    """Acceptance rate and mean accepted length (accepted drafts per verification step + 1) between two
    `get_metrics()` snapshots."""

    def delta(name: str) -> float:
        key = f"vlserve:spec_decode_num_{name}_total"
        return after[key] - before[key]

    drafts, accepted, steps = delta("draft_tokens"), delta("accepted_tokens"), delta("drafts")
    return {
        "acceptance": accepted / drafts if drafts else 0.0,
        "mean_accepted_len": accepted / steps + 1 if steps else 1.0,
    }


def run(model: str, prompts, output_len: int, spec: dict | None, dtype: str) -> dict:
    from vlserve import LLM, SamplingParams

    llm = LLM(
        model,
        dtype=dtype,
        speculative_config=spec,
        max_num_seqs=max(len(prompts), 1),
        max_model_len=len(prompts[0]) + output_len + 32,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    before = llm.get_metrics()
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_s": n / dt, "tokens": [o.outputs[0].token_ids for o in outs], **spec_stats(before, llm.get_metrics())}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local checkpoint; default: a random Qwen2 of the given size")
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--method", choices=["ngram", "eagle", "eagle3"], default="ngram")
    p.add_argument("--draft", default=None, help="EAGLE draft checkpoint directory (--method eagle/eagle3)")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--init-range",
        type=float,
        default=0.2,
        help="initializer_range of the random target (large values make it loop, so drafts can hit)",
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from vlserve.demo.checkpoints import build_text_checkpoint

        model = os.path.join(tempfile.mkdtemp(prefix="vlserve-specbench-"), "model")
        heads = max(args.hidden_size // 64, 1)
        build_text_checkpoint(
            model,
            arch="qwen2",
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_heads=heads,
            num_kv_heads=max(heads // 4, 1),
            intermediate_size=args.hidden_size * 3,
            initializer_range=args.init_range,
            seed=args.seed,
        )
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).get_text_config().vocab_size
    if args.method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
        label = "n-gram"
    else:
        draft = args.draft
        if draft is None:
            if args.method != "eagle":
                raise SystemExit("--method eagle3 needs --draft DIR")
            from vlserve.spec_decode.eagle_heads import build_eagle_checkpoint

            draft = build_eagle_checkpoint(tempfile.mkdtemp(prefix="vlserve-specbench-eagle-"), model, "eagle", "mimic")
            print(f"no --draft: built a head copied from the target's last layer at {draft}")
        spec = {"method": args.method, "num_speculative_tokens": args.k, "model": draft}
        label = args.method
    print(f"model {model}, {args.output_len} tokens out, {label} k={args.k}, {args.dtype}")
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        prompts = copy_heavy_prompts(bs, vocab, args.seed)
        plain = run(model, prompts, args.output_len, None, args.dtype)
        fast = run(model, prompts, args.output_len, spec, args.dtype)
        same = plain["tokens"] == fast["tokens"]
        print(
            f"batch {bs:2d}: plain {plain['tok_s']:7.1f} tok/s, {label} {fast['tok_s']:7.1f} tok/s, "
            f"speedup {fast['tok_s'] / plain['tok_s']:.2f}x, acceptance {fast['acceptance']:.2f}, "
            f"mean accepted length {fast['mean_accepted_len']:.2f}, identical outputs: {same}"
        )


if __name__ == "__main__":
    main()
