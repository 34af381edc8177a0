"""Speculative vs plain decoding on the demo model's own task, in one run, at batch 1 and batch 16.

    python -m vlserve.bench.spec_demo --method eagle      # the shipped EAGLE head (vlserve/demo/model/eagle)
    python -m vlserve.bench.spec_demo --method ngram      # copy-heavy: the question was asked and answered before

Prompts are held-out demo conversations (a fresh image or clip and a question of every form; greedy, up to 48
tokens, each answer ends at its own <|im_end|>). For n-gram the conversation repeats an earlier turn: the same
question about the same picture was already answered, so the answer can be copied from the prompt. Batch 1 sends
the requests one at a time; batch B sends them B at a time. Prints end-to-end output tokens/s, decode tokens/s
(after each request's first token), the speedups, the acceptance rate and the mean accepted length.
"""

from __future__ import annotations

import argparse
import time


def conversations(n: int, seed: int, repeat: bool) -> list[list[dict]]:
    """n chat conversations over fresh demo scenes; with repeat, the question was asked and answered once before."""
    from vlserve.demo import world
    from vlserve.demo.held_out import held_out_set, messages_for

    items = held_out_set(per_form=(n + len(world.FORMS) - 1) // len(world.FORMS), seed=seed)[:n]
    out = []
    for it in items:
        msgs = messages_for(it, "vlserve")
        if repeat:
            msgs = msgs + [{"role": "assistant", "content": it["answer"]}, {"role": "user", "content": it["question"]}]
        out.append(msgs)
    return out


def run(llm, convs: list, batch: int) -> dict:
    """Answer convs `batch` at a time -> token counts, wall time, decode time and the outputs' token ids."""
    from vlserve import SamplingParams
    from vlserve.bench.spec_decode import spec_stats

    sp = SamplingParams(temperature=0.0, max_tokens=48)
    llm.chat(convs[:1], sp, use_tqdm=False)  # warm-up
    before = llm.get_metrics()
    outs, t = [], time.perf_counter()
    for i in range(0, len(convs), batch):
        outs += llm.chat(convs[i : i + batch], sp, use_tqdm=False)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    decode_tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    decode_time = sum(o.metrics.last_token_time - o.metrics.first_token_time for o in outs)
    return {
        "tok_s": tokens / wall,
        "decode_tok_s": decode_tokens / decode_time if decode_time else 0.0,
        "ids": [o.outputs[0].token_ids for o in outs],
        "tokens": tokens,
        **spec_stats(before, llm.get_metrics()),
    }


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target checkpoint (default: the embedded demo model)")
    p.add_argument("--method", choices=["eagle", "eagle3", "ngram"], default="eagle")
    p.add_argument("--draft", default=None, help="draft directory (default: the demo model's shipped head)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--seed", type=int, default=4242)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = p.parse_args(argv)
    import torch

    from vlserve import LLM

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    else:
        spec = {"method": a.method, "num_speculative_tokens": a.k, **({"model": a.draft} if a.draft else {})}
    convs = conversations(a.num_prompts, a.seed, repeat=a.method == "ngram")
    plain_llm, spec_llm = LLM(a.model), LLM(a.model, speculative_config=spec)
    print(
        f"target {plain_llm.engine.loaded.model_path}, draft {spec_llm.engine.spec_config.model or '-'}, "
        f"{a.method} k={a.k}, {len(convs)} demo conversations{' (repeated question)' if a.method == 'ngram' else ''}"
    )
    for bs in (int(b) for b in a.batch_sizes.split(",")):
        plain, fast = run(plain_llm, convs, bs), run(spec_llm, convs, bs)
        print(
            f"batch {bs:2d}: plain {plain['tok_s']:6.1f} tok/s (decode {plain['decode_tok_s']:6.1f}), "
            f"{a.method} {fast['tok_s']:6.1f} tok/s (decode {fast['decode_tok_s']:6.1f}), speedup "
            f"{fast['tok_s'] / plain['tok_s']:.2f}x (decode {fast['decode_tok_s'] / plain['decode_tok_s']:.2f}x), "
            f"acceptance {fast['acceptance']:.2f}, mean accepted length {fast['mean_accepted_len']:.2f}, "
            f"{fast['tokens']} tokens, identical outputs: {plain['ids'] == fast['ids']}"
        )


if __name__ == "__main__":
    main()
