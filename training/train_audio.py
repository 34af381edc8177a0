"""Train the audio demo model from scratch on freshly rendered clips:
`python -m training.train_audio --out vlserve/demo/audio_model`.

HF's Qwen2AudioForConditionalGeneration (built by training.audio_build) is trained on short conversations
about one clip: the first question right after the audio (as at inference), follow-up questions reusing its tokens,
"Describe the audio." always last (asked earlier, it would hand the other answers to copy, which they cannot do at
inference). The loss is the answer-token cross entropy (training.train.answer_labels) plus a dense auxiliary
loss on the encoder's output: per audio token (40 ms) linear probes predict the pitch, the length and the ordinal of
the beep sounding there (targets from the clip, see `token_targets`), which makes a model this small learn to listen
in minutes. The probes are dropped when saving. Every step renders a new batch; everything is seeded, so the same
arguments give the same run. AdamW, warmup + cosine (training.schedule, on the clock when the `--minutes`
cap would stop the run first). The defaults (2600 steps of 8 clips, one torch thread + one rendering worker, a
45-minute cap) took 31 minutes on a 2-core machine running a test suite beside it, so the cap did not act.
"""

from __future__ import annotations

import argparse
import os
import random
import time

from training.schedule import in_background, lr_at, schedule_step

DEFAULT_STEPS = 2600
DEFAULT_BATCH = 8
DEFAULT_MINUTES = 45.0
DEFAULT_WARMUP = 40
# Relative frequency of each form in a conversation's turns: the whole description is the hardest.
FORM_WEIGHTS = {"count": 1.0, "first_pitch": 1.0, "last_pitch": 1.0, "longest": 1.0, "describe": 1.5}
NUM_PITCH_CLASSES = 4  # none, low, middle, high
NUM_LENGTH_CLASSES = 3  # none, short, long
NUM_ORDINAL_CLASSES = 6  # none, 1..5


def sample_turns(rng: random.Random, clip, max_turns: int) -> list[tuple[str, str, str]]:
    """1..max_turns distinct (form, question, answer) turns about `clip`, "describe" last when present."""
    from vlserve.demo import audio_world

    forms = list(audio_world.FORMS)
    chosen: list[str] = []
    for _ in range(rng.randint(1, max_turns)):
        form = rng.choices(forms, [FORM_WEIGHTS[f] for f in forms])[0]
        if form not in chosen:
            chosen.append(form)
    chosen.sort(key=lambda f: f == "describe")  # stable: the others keep their random order
    return [audio_world.sample_qa(rng, clip, f) for f in chosen]


def conversation(turns: list[tuple[str, str, str]]) -> list[dict]:
    """Messages: the audio and the first question in the first user turn, then the other turns."""
    msgs = []
    for i, (_, q, a) in enumerate(turns):
        content = ([{"type": "audio"}] if i == 0 else []) + [{"type": "text", "text": q}]
        msgs += [{"role": "user", "content": content}, {"role": "assistant", "content": a}]
    return msgs


def token_targets(clip, num_tokens: int) -> list[tuple[int, int, int]]:
    """Per audio token (SAMPLES_PER_TOKEN samples each): (pitch class, length class, ordinal) of the beep sounding at
    the token's center, (0, 0, 0) between beeps."""
    from training.audio_build import SAMPLES_PER_TOKEN
    from vlserve.demo import audio_world

    out = []
    for t in range(num_tokens):
        center = (t + 0.5) * SAMPLES_PER_TOKEN / audio_world.SAMPLE_RATE  # seconds
        label = (0, 0, 0)
        for i, b in enumerate(clip.beeps):
            if b.start <= center < b.start + b.duration:
                label = (1 + audio_world.PITCHES.index(b.pitch), 1 + audio_world.LENGTHS.index(b.length), 1 + i)
        out.append(label)
    return out


def make_batch(rng: random.Random, processor, batch_size: int, max_turns: int) -> dict:
    """Render batch_size fresh clips with conversations and run them through the processor; adds answer-only
    "labels", per-audio-token "aux_targets" [B, T, 3] (-100 past a clip's tokens) and "meta_forms"."""
    import torch

    from training.train import answer_labels
    from vlserve.demo import audio_world

    clips = [audio_world.sample_clip(rng) for _ in range(batch_size)]
    turns = [sample_turns(rng, c, max_turns) for c in clips]
    texts = [processor.apply_chat_template(conversation(t), tokenize=False) for t in turns]
    audio = [audio_world.render(c) for c in clips]
    batch = dict(
        processor(text=texts, audio=audio, sampling_rate=audio_world.SAMPLE_RATE, padding=True, return_tensors="pt")
    )
    batch["labels"] = answer_labels(batch["input_ids"], processor.tokenizer)
    num_positions = batch["input_features"].shape[-1] // 4  # pooled encoder positions
    frames = batch["feature_attention_mask"].sum(-1).tolist()
    aux = torch.full((batch_size, num_positions, 3), -100, dtype=torch.long)  # [B, T, 3]
    for b, (clip, n_frames) in enumerate(zip(clips, frames)):
        n_tokens = ((n_frames - 1) // 2 + 1 - 2) // 2 + 1  # as the processor counts them
        aux[b, :n_tokens] = torch.tensor(token_targets(clip, n_tokens))
    batch["aux_targets"] = aux
    batch["meta_forms"] = [t[0][0] for t in turns]
    return batch


class AudioBatchStream:
    """An endless, seeded stream of training batches (iterable; rendered in a DataLoader worker when asked)."""

    def __init__(self, processor, seed: int, batch_size: int, max_turns: int):
        self.processor, self.seed, self.batch_size, self.max_turns = processor, seed, batch_size, max_turns

    def __iter__(self):
        import torch

        torch.set_num_threads(1)
        rng = random.Random(self.seed)
        while True:
            yield make_batch(rng, self.processor, self.batch_size, self.max_turns)


def train(
    out: str,
    steps: int = DEFAULT_STEPS,
    batch_size: int = DEFAULT_BATCH,
    lr: float = 1.5e-3,
    minutes: float | None = None,
    seed: int = 0,
    max_turns: int = 3,
    warmup: int = DEFAULT_WARMUP,
    log_every: int = 50,
    threads: int = 1,
    workers: int = 1,
    aux_weight: float = 1.0,
    size=None,
) -> dict:
    """Train and save a checkpoint (model, tokenizer, processor) to `out`; return a summary dict. Stops early (still
    saving, on a decayed LR) when `minutes` run out."""
    import torch
    from tqdm import tqdm

    from training.audio_build import (
        audio_tower,
        build_audio_config,
        build_audio_model,
        build_audio_processor,
        build_audio_tokenizer,
    )
    from training.build import count_parameters
    from training.train import first_answer_correct

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tokenizer = build_audio_tokenizer()
    processor = build_audio_processor(tokenizer)
    model = build_audio_model(build_audio_config(tokenizer, size), seed=seed).train()
    encoder = audio_tower(model)
    probe = torch.nn.Linear(encoder.config.d_model, NUM_PITCH_CLASSES + NUM_LENGTH_CLASSES + NUM_ORDINAL_CLASSES)
    captured: dict = {}
    hook = encoder.register_forward_hook(lambda mod, args, output: captured.__setitem__("h", output[0]))
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.requires_grad and p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in named if p.requires_grad and not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay + list(probe.parameters()), "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.98),
        eps=1e-8,
    )
    data = in_background(AudioBatchStream(processor, seed, batch_size, max_turns), workers)
    t0 = start = time.time()
    ema, aux_ema, history, hits = None, None, [], {}
    bar = tqdm(range(steps), desc="train-audio", dynamic_ncols=True, mininterval=2.0)
    step = 0
    for step in bar:
        step_lr = lr_at(schedule_step(step, steps, time.time() - start, minutes), steps, lr, warmup)
        for g in opt.param_groups:
            g["lr"] = step_lr
        batch = next(data)
        inputs = {k: v for k, v in batch.items() if not k.startswith(("aux_", "meta_"))}
        res = model(**inputs)
        loss = res.loss
        if aux_weight > 0:
            logits = probe(captured["h"])  # [B, T, 13]
            tgt = batch["aux_targets"]  # [B, T, 3]
            splits = logits.split([NUM_PITCH_CLASSES, NUM_LENGTH_CLASSES, NUM_ORDINAL_CLASSES], dim=-1)
            aux = sum(
                torch.nn.functional.cross_entropy(s.flatten(0, 1), tgt[..., i].flatten(), ignore_index=-100)
                for i, s in enumerate(splits)
            )
            aux_ema = aux.item() if aux_ema is None else 0.95 * aux_ema + 0.05 * aux.item()
            loss = loss + aux_weight * aux
        with torch.no_grad():
            for form, ok in zip(batch["meta_forms"], first_answer_correct(res.logits, batch["labels"])):
                hits.setdefault(form, []).append(ok)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = res.loss.item() if ema is None else 0.95 * ema + 0.05 * res.loss.item()
        bar.set_postfix(loss=f"{ema:.4f}", aux=f"{aux_ema or 0:.3f}", lr=f"{step_lr:.2e}")
        if (step + 1) % log_every == 0:
            accs = {f: round(sum(v) / len(v), 2) for f, v in sorted(hits.items())}
            history.append(
                {
                    "step": step + 1,
                    "loss": round(ema, 4),
                    "seconds": round(time.time() - start, 1),
                    "first_answer_acc": accs,
                }
            )
            tqdm.write(
                f"step {step + 1} loss {ema:.4f} aux {aux_ema or 0:.4f} elapsed {time.time() - start:.0f}s"
                " | teacher-forced " + " ".join(f"{f} {a:.2f}" for f, a in accs.items())
            )
            hits = {}
        if minutes is not None and time.time() - start > 60 * minutes:
            tqdm.write(f"time budget of {minutes} min reached after {step + 1} steps; saving")
            break
    bar.close()
    hook.remove()
    model.eval()
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    portable_processor_files(processor, out)
    summary = {
        "steps": step + 1,
        "seconds": round(time.time() - t0, 1),
        "final_loss": ema,
        "parameters": count_parameters(model),
        "history": history,
    }
    print(
        f"saved to {out}: {summary['parameters']:,} parameters, {summary['steps']} steps, "
        f"{summary['seconds']:.0f}s, loss {ema:.4f}"
    )
    return summary


def portable_processor_files(processor, out: str) -> None:
    """Make a checkpoint saved by transformers 5.x load in 4.x too: write the feature extractor's own
    preprocessor_config.json, and list the special tokens under "additional_special_tokens" (4.x expects
    "extra_special_tokens" to be a dict; 5.x reads either)."""
    import json

    processor.feature_extractor.save_pretrained(out)
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    extra = cfg.get("extra_special_tokens")
    if isinstance(extra, list):
        cfg["additional_special_tokens"], cfg["extra_special_tokens"] = extra, {}
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2, ensure_ascii=False)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description="Train the vlserve audio demo model on freshly rendered beep clips.")
    p.add_argument("--out", required=True, help="output directory (a standard HF checkpoint)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--minutes", type=float, default=DEFAULT_MINUTES, help="wall-clock cap; saves when reached")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads for the model (data renders in a worker)")
    p.add_argument("--workers", type=int, default=1, help="0 renders batches in the training process")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="linear LR warmup steps")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--aux-weight", type=float, default=1.0, help="weight of the encoder's dense probe loss (0: off)")
    a = p.parse_args(argv)
    train(
        a.out,
        steps=a.steps,
        batch_size=a.batch_size,
        lr=a.lr,
        minutes=a.minutes,
        seed=a.seed,
        max_turns=a.max_turns,
        threads=a.threads,
        workers=a.workers,
        log_every=a.log_every,
        warmup=a.warmup,
        aux_weight=a.aux_weight,
    )


if __name__ == "__main__":
    main()
