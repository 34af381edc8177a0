"""Evaluate the demo model on a fresh, seeded held-out set:
`python -m training.eval [--engine vlserve|hf|both]`; with `--video-pruning-rates 0,0.5,0.75` the video forms at
each video pruning rate instead (training.eval_pruning).

Renders `--per-form` new scenes for every question form (a seed the training stream never uses), asks the question
greedily, and scores exact matches of the whole answer (case and surrounding whitespace ignored); a "json" answer
is right when it parses to the expected object and fits world.DEMO_JSON_SCHEMA (its validity, i.e. whether it fits
the schema at all, is printed too). Prints accuracy per form and overall; the last line is `accuracy: 0.xx`.
"""

from __future__ import annotations

import argparse
import time

from vlserve.demo.held_out import EVAL_SEED, held_out_set, messages_for

# A "json" answer about 3 shapes is 109 tokens (the demo vocabulary has no JSON merges); the other forms stop well
# within 48, so the larger cap leaves their answers as they were.
MAX_NEW_TOKENS = 128


def generate_hf(model_dir: str, items: list[dict], batch_size: int = 16, threads: int = 2) -> list[str]:
    """Greedy answers from transformers' AutoModelForImageTextToText + AutoProcessor (left-padded batches)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.set_num_threads(threads)
    processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    outs: list[str] = []
    # Same-kind batches: a batch is all images or all videos.
    for i in range(0, len(items), batch_size):
        chunk = items[i : i + batch_size]
        texts = [
            processor.apply_chat_template(messages_for(it, "hf"), tokenize=False, add_generation_prompt=True)
            for it in chunk
        ]
        images = [it["media"] for it in chunk if it["kind"] == "image"] or None
        videos = [it["media"] for it in chunk if it["kind"] == "video"] or None
        batch = processor(text=texts, images=images, videos=videos, padding=True, return_tensors="pt")
        with torch.inference_mode():
            gen = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)  # [B, L + new]
        new = gen[:, batch["input_ids"].shape[1] :]  # [B, new]
        outs += processor.tokenizer.batch_decode(new, skip_special_tokens=True)
    return outs


def chat_answers(model_dir: str, conversations: list[list[dict]], max_tokens: int = MAX_NEW_TOKENS) -> list[str]:
    """Greedy answers from vlserve's `LLM.chat` to these conversations (the whole set in one continuous batch)."""
    from vlserve import LLM, SamplingParams

    llm = LLM(model=model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


def generate_vlserve(model_dir: str, items: list[dict]) -> list[str]:
    """Greedy answers from vlserve's `LLM.chat` (the whole set in one continuous batch)."""
    return chat_answers(model_dir, [messages_for(it, "vlserve") for it in items])


def json_right(output: str, expected: str) -> bool:
    """A "json" answer is right when it parses to exactly the expected object and fits world.DEMO_JSON_SCHEMA."""
    import json

    from vlserve.demo import world

    try:
        value = json.loads(output)
    except ValueError:
        return False
    return value == json.loads(expected) and world.fits_json_schema(output)


def is_right(item: dict, output: str) -> bool:
    """Whether `output` answers `item`: json_right for the "json" form, else an exact match of the whole answer
    (case and surrounding whitespace ignored)."""
    if item["form"] == "json":
        return json_right(output, item["answer"])
    return output.strip().lower() == item["answer"].strip().lower()


def score(items: list[dict], outputs: list[str], forms: tuple[str, ...] | None = None) -> dict[str, float]:
    """Accuracy per form (default: the vision world's forms; see is_right) plus "overall", and "json_valid" (the
    share of "json" answers that fit world.DEMO_JSON_SCHEMA) when there are "json" items."""
    from vlserve.demo import world

    per: dict[str, list[bool]] = {f: [] for f in (forms or world.FORMS)}
    valid = []
    for it, out in zip(items, outputs):
        per[it["form"]].append(is_right(it, out))
        if it["form"] == "json":
            valid.append(world.fits_json_schema(out))
    acc = {f: sum(v) / len(v) for f, v in per.items() if v}
    acc["overall"] = sum(sum(v) for v in per.values()) / max(1, sum(len(v) for v in per.values()))
    if valid:
        acc["json_valid"] = sum(valid) / len(valid)
    return acc


def evaluate(
    model_dir: str | None = None,
    engine: str = "vlserve",
    per_form: int = 50,
    seed: int = EVAL_SEED,
    batch_size: int = 16,
    show_errors: int = 3,
) -> dict[str, float]:
    """Run the held-out evaluation, print the table, and return the accuracies. engine "both" scores vlserve and
    also prints how many of its answers equal HF generate's (the returned dict then has "hf_agreement")."""
    import os

    from vlserve.demo import default_model_path, world

    model_dir = model_dir or default_model_path()
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"no checkpoint at {model_dir!r} (expected a directory with config.json)")
    items = held_out_set(per_form, seed)
    return run_and_report(
        model_dir, engine, items, lambda d, its: generate_hf(d, its, batch_size), generate_vlserve, world, show_errors
    )


def run_and_report(
    model_dir: str, engine: str, items: list[dict], hf_answers, vlserve_answers, world_module, show_errors: int
) -> dict[str, float]:
    """Answer `items` with the chosen engine (`hf_answers` / `vlserve_answers`: (model_dir, items) -> texts),
    print the per-form table of `world_module` (its FORMS and QUESTION_TEMPLATES) and the first wrong answers, and
    return the accuracies (plus "hf_agreement" for engine "both")."""
    t0 = time.time()
    outputs = hf_answers(model_dir, items) if engine == "hf" else vlserve_answers(model_dir, items)
    acc = score(items, outputs, world_module.FORMS)
    if engine == "both":
        hf = hf_answers(model_dir, items)
        same = sum(a.strip() == b.strip() for a, b in zip(outputs, hf))
        acc["hf_agreement"] = same / len(items)
        print(f"vlserve == HF generate on {same}/{len(items)} answers")
    print(f"model {model_dir} | engine {engine} | {len(items)} questions | {time.time() - t0:.0f}s")
    width = max(len(f) for f in world_module.FORMS) + 4
    print(f"{'form':<{width}} {'question':<40} {'accuracy':>8}")
    for f in world_module.FORMS:
        print(f"{f:<{width}} {world_module.QUESTION_TEMPLATES[f]:<40} {acc[f]:>8.3f}")
    if "json_valid" in acc:
        n_json = sum(it["form"] == "json" for it in items)
        print(f"json answers that fit the schema (valid): {acc['json_valid']:.3f} of {n_json}")
    wrong = [(it, o) for it, o in zip(items, outputs) if not is_right(it, o)]
    for it, o in wrong[:show_errors]:
        print(f"  wrong [{it['form']}] {it['question']!r}: got {o.strip()!r}, expected {it['answer']!r}")
    print(f"overall accuracy over {len(items)} questions: {acc['overall']:.4f}")
    print(f"accuracy: {acc['overall']:.2f}")
    return acc


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description="Held-out accuracy of the vlserve demo model, per question form.")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded demo model)")
    p.add_argument(
        "--engine",
        choices=("vlserve", "hf", "both"),
        default="vlserve",
        help="who answers (both: vlserve, plus agreement with HF generate)",
    )
    p.add_argument("--per-form", type=int, default=50)
    p.add_argument("--seed", type=int, default=EVAL_SEED)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--show-errors", type=int, default=3)
    p.add_argument(
        "--video-pruning-rates",
        default=None,
        help="e.g. 0,0.5,0.75: the video forms at each pruning rate (accuracy, tokens per video, TTFT; "
        "see training.eval_pruning) instead of the whole set",
    )
    p.add_argument("--ttft-samples", type=int, default=8, help="single requests timed per rate (pruning mode)")
    a = p.parse_args(argv)
    if a.video_pruning_rates is not None:
        from training.eval_pruning import evaluate_pruning, parse_rates

        evaluate_pruning(a.model, parse_rates(a.video_pruning_rates), a.per_form, a.seed, a.ttft_samples)
        return
    evaluate(a.model, a.engine, a.per_form, a.seed, a.batch_size, a.show_errors)


if __name__ == "__main__":
    main()
