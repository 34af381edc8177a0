"""Evaluate the audio demo model on fresh, seeded held-out clips:
`python -m training.eval_audio [--engine hf|vlserve|both]`.

Renders `--per-form` new clips for every question form (a seed the training stream never uses), asks the question
greedily, and scores exact matches of the whole answer (case and surrounding whitespace ignored). HF generate gets
the rendered float waveform; vlserve gets the same clip as a 16-bit WAV in an OpenAI `input_audio` chat part (so
the two see waveforms that differ by the 16-bit rounding). Prints accuracy per form and overall; the last line is
`accuracy: 0.xx`.
"""

from __future__ import annotations

import argparse
import base64
import os
import random

EVAL_SEED = 20240917
MAX_NEW_TOKENS = 40


def held_out_set(per_form: int, seed: int = EVAL_SEED) -> list[dict]:
    """per_form items per question form: {"form", "clip", "audio" (float32 [samples]), "question", "answer"}."""
    from vlserve.demo import audio_world

    rng = random.Random(seed)
    items = []
    for form in audio_world.FORMS:
        for _ in range(per_form):
            clip = audio_world.sample_clip(rng)
            _, q, a = audio_world.sample_qa(rng, clip, form)
            items.append({"form": form, "clip": clip, "audio": audio_world.render(clip), "question": q, "answer": a})
    return items


def messages_for(item: dict, engine: str) -> list[dict]:
    """One user turn: the audio part (HF processor format, or an OpenAI input_audio part with base64 WAV for
    vlserve) and the question."""
    from vlserve.demo import audio_world

    if engine == "hf":
        audio = {"type": "audio"}
    else:
        data = base64.b64encode(audio_world.to_wav_bytes(item["audio"])).decode("ascii")
        audio = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    return [{"role": "user", "content": [audio, {"type": "text", "text": item["question"]}]}]


def generate_hf(model_dir: str, items: list[dict], batch_size: int = 16, threads: int = 2) -> list[str]:
    """Greedy answers from transformers' Qwen2AudioForConditionalGeneration + AutoProcessor (left-padded)."""
    import torch
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    from vlserve.demo.audio_world import SAMPLE_RATE

    torch.set_num_threads(threads)
    processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    processor.tokenizer.padding_side = "left"
    model = Qwen2AudioForConditionalGeneration.from_pretrained(
        model_dir, local_files_only=True, dtype=torch.float32
    ).eval()
    outs: list[str] = []
    for i in range(0, len(items), batch_size):
        chunk = items[i : i + batch_size]
        texts = [
            processor.apply_chat_template(messages_for(it, "hf"), tokenize=False, add_generation_prompt=True)
            for it in chunk
        ]
        batch = processor(
            text=texts,
            audio=[it["audio"] for it in chunk],
            sampling_rate=SAMPLE_RATE,
            padding=True,
            return_tensors="pt",
        )
        with torch.inference_mode():
            gen = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)  # [B, L + new]
        new = gen[:, batch["input_ids"].shape[1] :]  # [B, new]
        outs += processor.tokenizer.batch_decode(new, skip_special_tokens=True)
    return outs


def generate_vlserve(model_dir: str, items: list[dict]) -> list[str]:
    """Greedy answers from vlserve's `LLM.chat` with input_audio parts (the whole set in one continuous batch)."""
    from training.eval import chat_answers

    return chat_answers(model_dir, [messages_for(it, "vlserve") for it in items], MAX_NEW_TOKENS)


def score(items: list[dict], outputs: list[str]) -> dict[str, float]:
    """Exact-match accuracy per audio form plus "overall"."""
    from training import eval as vision_eval
    from vlserve.demo import audio_world

    return vision_eval.score(items, outputs, audio_world.FORMS)


def evaluate(
    model_dir: str | None = None,
    engine: str = "hf",
    per_form: int = 100,
    seed: int = EVAL_SEED,
    batch_size: int = 16,
    show_errors: int = 5,
    threads: int = 2,
) -> dict[str, float]:
    """Run the held-out evaluation, print the table, and return the accuracies. engine "both" scores vlserve and
    also prints how many of its answers equal HF generate's (the returned dict then has "hf_agreement")."""
    from vlserve.demo import audio_world, demo_model_path

    model_dir = model_dir or demo_model_path("vlserve-demo-audio")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"no checkpoint at {model_dir!r} (expected a directory with config.json)")
    if engine not in ("hf", "vlserve", "both"):
        raise ValueError(f"engine must be hf, vlserve or both, got {engine[:50]!r}")
    from training.eval import run_and_report

    items = held_out_set(per_form, seed)
    return run_and_report(
        model_dir,
        engine,
        items,
        lambda d, its: generate_hf(d, its, batch_size, threads),
        generate_vlserve,
        audio_world,
        show_errors,
    )


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description="Held-out accuracy of the vlserve audio demo model, per question form.")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded vlserve-demo-audio)")
    p.add_argument(
        "--engine",
        choices=("hf", "vlserve", "both"),
        default="hf",
        help="who answers (both: vlserve, plus agreement with HF generate)",
    )
    p.add_argument("--per-form", type=int, default=100)
    p.add_argument("--seed", type=int, default=EVAL_SEED)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--show-errors", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="torch threads for HF generate")
    a = p.parse_args(argv)
    evaluate(a.model, a.engine, a.per_form, a.seed, a.batch_size, a.show_errors, a.threads)


if __name__ == "__main__":
    main()
