"""The held-out evaluation of the demo model's video questions under video pruning:
`.venv/bin/python -m training.eval --video-pruning-rates 0,0.5,0.75 [--per-form N] [--ttft-samples K]`.

One `LLM` serves every rate (as each request's `video_pruning_rate`). At each rate, first `--ttft-samples` of the
videos are asked one at a time, each its only request, for one token, the processor's cache cleared first: the wall
time of that call is the time to first token, media decoding, the HF processor and the tower included (no cache
helps: the rate is in the mm_hash, and these videos are new at this rate). Then the video forms' held-out questions
are answered greedily (the whole set in one continuous batch) and scored as training.eval scores them.
Prints one table: accuracy per form and overall, video placeholder tokens per video, median and max TTFT.
"""

from __future__ import annotations

import statistics
import time


def parse_rates(text: str) -> list[float]:
    """ "0,0.5,0.75" -> [0.0, 0.5, 0.75]; ValueError for anything outside [0, 1)."""
    from vlserve.multimodal.video_pruning import check_video_pruning_rate

    rates = [check_video_pruning_rate(float(part), "--video-pruning-rates") for part in text.split(",") if part]
    if not rates:
        raise ValueError("--video-pruning-rates needs at least one rate")
    return rates


def measure_rate(llm, items: list[dict], rate: float, ttft_samples: int) -> dict:
    """Accuracy per form, video tokens per video and TTFTs (seconds) of the items at one rate."""
    from training.eval import MAX_NEW_TOKENS, score
    from vlserve import SamplingParams
    from vlserve.demo import world
    from vlserve.demo.held_out import messages_for

    kwargs = {"video_pruning_rate": rate}
    conversations = [messages_for(it, "vlserve") for it in items]
    processor = llm.input_processor.mm_processor
    ttfts = []  # first: these videos are new at this rate (no prefix or encoder cache hit)
    for conversation in conversations[:ttft_samples]:
        processor.clear_cache()
        t0 = time.perf_counter()
        llm.chat(
            conversation, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False, mm_processor_kwargs=kwargs
        )
        ttfts.append(time.perf_counter() - t0)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outputs = llm.chat(conversations, greedy, use_tqdm=False, mm_processor_kwargs=kwargs)
    tokens = [o.prompt_token_ids.count(processor.video_token_id) for o in outputs]
    return {
        "accuracy": score(items, [o.outputs[0].text for o in outputs], world.VIDEO_FORMS),
        "video_tokens": statistics.mean(tokens),
        "ttft": ttfts,
    }


def evaluate_pruning(model_dir: str | None, rates: list[float], per_form: int, seed: int, ttft_samples: int) -> dict:
    """Run every rate on the video forms' held-out set and print the table; returns {rate: measure_rate's dict}."""
    from vlserve import LLM
    from vlserve.demo import default_model_path, world
    from vlserve.demo.held_out import held_out_set

    model_dir = model_dir or default_model_path()
    items = [it for it in held_out_set(per_form, seed) if it["form"] in world.VIDEO_FORMS]
    llm = LLM(model=model_dir)
    warm_up = [
        {"role": "user", "content": [{"type": "video", "video": items[-1]["media"]}, {"type": "text", "text": "?"}]}
    ]
    llm.chat(warm_up, use_tqdm=False)  # the first request's one-time costs stay out of the first rate's TTFT
    ttft_samples = min(ttft_samples, len(items) - 1)  # (not the warm-up's video)
    results = {rate: measure_rate(llm, items, rate, ttft_samples) for rate in rates}
    print(f"model {model_dir} | {len(items)} video questions | TTFT over {ttft_samples} single requests")
    forms = [*world.VIDEO_FORMS, "overall"]
    print(f"{'rate':>5} " + " ".join(f"{f:>14}" for f in forms) + f" {'tokens/video':>13} {'ttft p50':>9} {'max':>7}")
    for rate, r in results.items():
        ttft = r["ttft"]
        p50, top = (f"{statistics.median(ttft) * 1e3:7.0f}ms", f"{max(ttft) * 1e3:5.0f}ms") if ttft else ("-", "-")
        cells = " ".join(f"{r['accuracy'].get(f, float('nan')):>14.3f}" for f in forms)
        print(f"{rate:>5.2f} {cells} {r['video_tokens']:>13.1f} {p50:>9} {top:>7}")
    return results
