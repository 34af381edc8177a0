"""Train the demo model from scratch on freshly rendered scenes: `python -m training.train --out DIR`.

Every step renders a new batch (infinite data), so the model learns the world rather than a fixed set. Stage 1
(training.vision_stage) trains the vision tower alone on dense per-patch / per-cell targets. Stage 2 trains the
whole model on short conversations about one image or clip (the first question right after the media, like at
inference; follow-up questions reuse the same visual tokens): the loss covers the assistant answers (+ <|im_end|>),
plus deep supervision of intermediate states (training.targets) without which a model this small, trained this
briefly from scratch, does not learn to look at the image. AdamW with warmup + cosine decay; everything is seeded
(scenes from random.Random(seed), weights from torch.manual_seed(seed)), so the same arguments give the same run.
The defaults (600 vision steps of 32 items, then 3000 steps of 8 conversations; one torch thread + one rendering
worker) fit the default 40-minute cap on 2 CPU cores; on a slower machine the cap stops a stage early (still saving),
and that stage's LR schedule then runs on the clock (`schedule.schedule_step`), so that it still ends decayed.

`--init-from DIR` fine-tunes instead (e.g. the shipped vlserve/demo/model on a newly added question form): stage 2
starts from DIR's weights, stage 1 is skipped, and DIR's tokenizer / processor files are copied unchanged. The
"json" form was added this way: `--init-from vlserve/demo/model --minutes 25 --lr 5e-4 --seed 1` (1951 steps on
2 CPU cores; a fresh seed so that the stream is not the one the checkpoint was trained on).
"""

from __future__ import annotations

import argparse
import os
import random
import time

from training.schedule import in_background, lr_at, schedule_step

DEFAULT_VISION_STEPS = 600
DEFAULT_STEPS = 3000
DEFAULT_BATCH = 8
# How often each question form is asked in training conversations (relative, within images / within clips): the
# forms that need every fact right in one sentence (descriptions, places) and the kind of the shape get more turns;
# counting and direction are learned early and get fewer.
# "json" (the picture as JSON, a long answer that restates the picture's facts) gets 1.5 so that a fine-tune
# (`--init-from`) learns it quickly.
FORM_WEIGHTS = {
    "shape": 1.5,
    "color": 1.0,
    "count": 0.5,
    "where": 1.5,
    "describe": 2.5,
    "direction": 0.5,
    "moving_color": 0.75,
    "describe_video": 2.0,
    "json": 1.5,
}
# Forms whose question names a shape's kind or color. A conversation asks them after the others: asked first, they
# would hand a later "Describe the video." the kind to copy, which it cannot do at inference (one question, no hints).
NAMING_FORMS = ("color", "where", "direction")


def render_sample(rng: random.Random, is_video: bool, max_turns: int):
    """-> (kind "image" | "video", media (PIL image | list of frames), [(form, question, answer), ...], scene); the
    turns that name a kind or color (NAMING_FORMS) come last."""
    from vlserve.demo import world

    scene = world.sample_video(rng) if is_video else world.sample_scene(rng)
    all_qas = world.qas(scene)
    forms = sorted({f for f, _, _ in all_qas})
    turns = []
    weights = [FORM_WEIGHTS[f] for f in forms]
    for _ in range(rng.randint(1, max_turns)):
        qa = world.sample_qa(rng, scene, rng.choices(forms, weights)[0])
        if all(qa[1] != t[1] for t in turns):
            turns.append(qa)
    turns.sort(key=lambda t: t[0] in NAMING_FORMS)  # stable: the others keep their order
    media = world.render_video(scene) if is_video else world.render_image(scene)
    return ("video" if is_video else "image"), media, turns, scene


def conversation(kind: str, turns: list[tuple[str, str, str]]) -> list[dict]:
    """OpenAI-style messages: the media and first question in the first user turn, then the other turns."""
    msgs = []
    for i, (_, q, a) in enumerate(turns):
        content = ([{"type": kind}] if i == 0 else []) + [{"type": "text", "text": q}]
        msgs += [{"role": "user", "content": content}, {"role": "assistant", "content": a}]
    return msgs


def answer_labels(input_ids, tokenizer):
    """Labels for a padded [B, L] id tensor: the ids of every assistant answer and its <|im_end|>; -100 elsewhere."""
    import torch

    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    header = tokenizer("assistant\n").input_ids  # the tokens between <|im_start|> and the answer
    labels = torch.full_like(input_ids, -100)  # [B, L]
    for b, row in enumerate(input_ids.tolist()):
        i = 0
        while i < len(row):
            if row[i] == im_start and row[i + 1 : i + 1 + len(header)] == header:
                j = i + 1 + len(header)
                while j < len(row) and row[j] != im_end:
                    j += 1
                labels[b, i + 1 + len(header) : j + 1] = input_ids[b, i + 1 + len(header) : j + 1]
                i = j
            i += 1
    return labels


def make_batch(rng: random.Random, processor, batch_size: int, video_prob: float = 0.3, max_turns: int = 3):
    """Render batch_size fresh samples (all clips with probability video_prob, else all images: a batch padded to
    its longest clip would waste most of an image batch) and run them through the processor; adds answer-only
    "labels" and the auxiliary per-visual-token targets ("aux_*", see training.targets)."""
    from training.targets import batch_targets

    is_video = rng.random() < video_prob
    samples = [render_sample(rng, is_video, max_turns) for _ in range(batch_size)]
    texts = [processor.apply_chat_template(conversation(k, t), tokenize=False) for k, _, t, _ in samples]
    images = [m for k, m, _, _ in samples if k == "image"] or None
    videos = [m for k, m, _, _ in samples if k == "video"] or None
    batch = dict(processor(text=texts, images=images, videos=videos, padding=True, return_tensors="pt"))
    batch["labels"] = answer_labels(batch["input_ids"], processor.tokenizer)
    batch.update(batch_targets([sc for *_, sc in samples], batch.get("image_grid_thw"), batch.get("video_grid_thw")))
    batch["meta_forms"] = [t[0][0] for _, _, t, _ in samples]  # the first question's form, for logging
    return batch


def first_answer_correct(logits, labels) -> list[bool]:
    """Per sample: whether teacher-forced argmax predicts every token of the first answer (a proxy for greedy
    exact match). logits [B, L, V], labels [B, L]."""
    pred = logits[:, :-1].argmax(-1)  # [B, L-1]: the prediction for position t+1
    tgt = labels[:, 1:]  # [B, L-1]
    out = []
    for b in range(labels.shape[0]):
        idx = (tgt[b] != -100).nonzero().flatten().tolist()
        run = [i for k, i in enumerate(idx) if i - k == idx[0]]  # the first contiguous labeled span
        out.append(bool((pred[b, run] == tgt[b, run]).all()))
    return out


class BatchStream:
    """An endless, seeded stream of training batches (iterable; rendered in a DataLoader worker when asked)."""

    def __init__(self, processor, seed: int, batch_size: int, video_prob: float, max_turns: int):
        self.processor, self.seed, self.batch_size = processor, seed, batch_size
        self.video_prob, self.max_turns = video_prob, max_turns

    def __iter__(self):
        import torch

        torch.set_num_threads(1)
        rng = random.Random(self.seed)
        while True:
            yield make_batch(rng, self.processor, self.batch_size, self.video_prob, self.max_turns)


def batches(processor, seed: int, batch_size: int, video_prob: float, max_turns: int, workers: int):
    """Iterator over training batches; with workers=1 they are rendered in a background process (same order)."""
    return in_background(BatchStream(processor, seed, batch_size, video_prob, max_turns), workers)


def linear_patch_embed(model):
    """Run the vision tower's patch embedding (a Conv3d whose kernel equals its stride) as the equivalent Linear on
    the flattened patches: same weights and result (to float rounding); stage-1 steps took ~25% less time with it
    on the 2-core machine. Returns a function that restores the module's own forward."""
    import torch.nn.functional as F

    pe = model.model.visual.patch_embed
    # pixels [P, C*tp*p*p] (the processor's patch order matches the Conv3d weight's flattening) -> [P, embed_dim]
    pe.forward = lambda x: F.linear(
        x.reshape(-1, pe.proj.weight[0].numel()).to(pe.proj.weight.dtype), pe.proj.weight.view(pe.embed_dim, -1)
    )
    return lambda: pe.__dict__.pop("forward", None)


def eager_attention_only_in(model, layer: int):
    """Compute attention probabilities only where the pointer loss reads them: the model (and its mask) runs
    "eager", but every other text layer and the vision tower get SDPA through their own config copy (with
    one-kind batches, stage-2 steps took ~5% less time). A forward hook on that layer's attention keeps its
    probabilities `[B, heads, L, L]` in `captured["probs"]` after each forward (transformers 4.x and 5.x alike:
    5.x's `output_attentions` leaves out the SDPA layers). Returns `(captured, restore)`; `restore()` puts the
    shared configs back and removes the hook."""
    import copy

    model.set_attn_implementation("eager")
    modules = [blk.attn for blk in model.model.visual.blocks]
    modules += [lyr.self_attn for i, lyr in enumerate(model.model.language_model.layers) if i != layer]
    shared = [m.config for m in modules]
    for m in modules:
        m.config = copy.copy(m.config)
        m.config._attn_implementation = "sdpa"
    captured: dict = {}
    hook = model.model.language_model.layers[layer].self_attn.register_forward_hook(
        lambda mod, args, out: captured.__setitem__("probs", out[1])
    )

    def restore():
        hook.remove()
        for m, cfg in zip(modules, shared):
            m.config = cfg
        model.set_attn_implementation("sdpa")

    return captured, restore


def train(
    out: str,
    steps: int = DEFAULT_STEPS,
    batch_size: int = DEFAULT_BATCH,
    lr: float = 2e-3,
    minutes: float | None = None,
    seed: int = 0,
    video_prob: float = 0.3,
    max_turns: int = 5,
    warmup: int = 60,
    log_every: int = 50,
    threads: int = 1,
    workers: int = 1,
    aux_weight: float = 1.0,
    size=None,
    vision_steps: int = DEFAULT_VISION_STEPS,
    vision_minutes: float | None = None,
    init_from: str | None = None,
) -> dict:
    """Train and save a checkpoint (model, tokenizer, processor) to `out`; return a summary dict.

    With `init_from` (a checkpoint directory, e.g. the shipped vlserve/demo/model) it fine-tunes instead: the model
    starts from that checkpoint's weights, stage 1 is skipped (`vision_steps` ignored; the vision tower keeps
    learning at half the LR, as after stage 1), and the tokenizer / processor files are copied from it unchanged.

    Stage 1 (`vision_steps`, training.vision_stage) trains the vision tower alone on dense targets; stage 2
    (`steps`) trains everything on the answer-token cross entropy plus aux_weight times the dense auxiliary losses
    (training.targets). Either stage stops early if its share of `minutes` (vision_minutes for stage 1) runs
    out; the checkpoint is saved either way (a stage's LR schedule follows the clock when the clock is ahead).
    """
    import torch
    from tqdm import tqdm

    from training.build import build_config, build_model, build_processor, count_parameters
    from training.targets import ATTN_LAYER, NUM_CELL_OUTPUTS, AuxHeads
    from training.tokenizer import build_demo_tokenizer
    from training.vision_stage import pretrain_vision

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    if init_from is not None:
        from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

        processor = AutoProcessor.from_pretrained(init_from, local_files_only=True)
        model = Qwen2VLForConditionalGeneration.from_pretrained(
            init_from, local_files_only=True, dtype=torch.float32
        ).train()
        vision_steps = 0
    else:
        tokenizer = build_demo_tokenizer()
        processor = build_processor(tokenizer)
        model = build_model(build_config(tokenizer, size), seed=seed).train()
    hidden = model.config.text_config.hidden_size
    cell_probe = torch.nn.Linear(hidden, NUM_CELL_OUTPUTS)
    restore_patch_embed = linear_patch_embed(model)
    t0 = time.time()
    vision = {"steps": 0, "seconds": 0.0, "history": []}
    if vision_steps > 0:
        vision = pretrain_vision(
            model, processor, cell_probe, vision_steps, lr=1e-3, seed=seed, workers=workers, minutes=vision_minutes
        )
    if minutes is not None:
        minutes = max(1.0, minutes - (time.time() - t0) / 60)
    heads = AuxHeads(hidden, cell_probe)
    token_ids = {
        "image": model.config.image_token_id,
        "video": model.config.video_token_id,
        "vision_end": model.config.vision_end_token_id,
    }
    # the pointer-head loss needs layer ATTN_LAYER's attention probabilities (the model starts on SDPA)
    captured, restore_attention = ({}, lambda: None)
    if aux_weight > 0:
        captured, restore_attention = eager_attention_only_in(model, ATTN_LAYER)
    named = list(model.named_parameters())
    vision_params = [p for n, p in named if ".visual." in f".{n}"] + list(cell_probe.parameters())
    seen = {id(p) for p in vision_params}
    decay = [p for n, p in named if p.ndim >= 2 and "embed" not in n and id(p) not in seen]
    no_decay = [p for n, p in named if not (p.ndim >= 2 and "embed" not in n) and id(p) not in seen]
    no_decay += [p for p in heads.parameters() if id(p) not in seen]
    # the vision tower comes pre-trained from stage 1: it keeps learning, at a fraction of the LM's rate
    vision_scale = 0.5 if vision_steps > 0 or init_from is not None else 1.0
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.05, "scale": 1.0},
            {"params": no_decay, "weight_decay": 0.0, "scale": 1.0},
            {"params": vision_params, "weight_decay": 0.0, "scale": vision_scale},
        ],
        lr=lr,
        betas=(0.9, 0.98),
        eps=1e-8,
    )
    data = batches(processor, seed, batch_size, video_prob, max_turns, workers)
    start, ema, aux_ema, history, hits, aux_parts = time.time(), None, None, [], {}, {}
    bar = tqdm(range(steps), desc="train", dynamic_ncols=True, mininterval=2.0)
    step = 0
    for step in bar:
        step_lr = lr_at(schedule_step(step, steps, time.time() - start, minutes), steps, lr, warmup)
        for g in opt.param_groups:
            g["lr"] = g["scale"] * step_lr
        batch = next(data)
        inputs = {k: v for k, v in batch.items() if not k.startswith(("aux_", "meta_"))}
        res = model(**inputs, output_hidden_states=aux_weight > 0)
        loss = res.loss
        with torch.no_grad():
            for form, ok in zip(batch["meta_forms"], first_answer_correct(res.logits, batch["labels"])):
                hits.setdefault(form, []).append(ok)
        if aux_weight > 0:
            parts = heads.loss(
                res.hidden_states, captured["probs"], batch["input_ids"], batch["attention_mask"], token_ids, batch
            )
            aux = sum(parts.values())
            aux_ema = aux.item() if aux_ema is None else 0.95 * aux_ema + 0.05 * aux.item()
            for k, v in parts.items():
                aux_parts[k] = aux_parts.get(k, 0.0) + v.item()
            loss = loss + aux_weight * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = res.loss.item() if ema is None else 0.95 * ema + 0.05 * res.loss.item()
        bar.set_postfix(loss=f"{ema:.4f}", aux=f"{aux_ema or 0:.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}")
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
                f"step {step + 1} loss {ema:.4f} aux {aux_ema or 0:.4f} elapsed {time.time() - start:.0f}s | "
                + " ".join(f"{k} {v / log_every:.2f}" for k, v in aux_parts.items())
                + " | teacher-forced "
                + " ".join(f"{f} {a:.2f}" for f, a in accs.items())
            )
            hits, aux_parts = {}, {}
        if minutes is not None and time.time() - start > 60 * minutes:
            tqdm.write(f"time budget of {minutes} min reached after {step + 1} steps; saving")
            break
    bar.close()
    restore_patch_embed()
    model.eval()
    restore_attention()  # back to SDPA everywhere, as saved
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if init_from is None:
        processor.save_pretrained(out)
    else:
        copy_processor_files(init_from, out)
    summary = {
        "steps": step + 1,
        "seconds": round(time.time() - t0, 1),
        "final_loss": ema,
        "parameters": count_parameters(model),
        "history": history,
        "vision_stage": vision,
        "init_from": init_from,
    }
    print(
        f"saved to {out}: {summary['parameters']:,} parameters, {vision['steps']} vision steps + "
        f"{summary['steps']} steps, {summary['seconds']:.0f}s, loss {ema:.4f}"
    )
    return summary


# A checkpoint's tokenizer / processor files (what a fine-tune copies unchanged from its --init-from directory).
PROCESSOR_FILES = (
    "chat_template.jinja",
    "merges.txt",
    "preprocessor_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "video_preprocessor_config.json",
    "vocab.json",
)


def copy_processor_files(src: str, dst: str) -> list[str]:
    """Copy the PROCESSOR_FILES present in `src` into `dst` byte for byte; return the names copied."""
    import shutil

    names = [n for n in PROCESSOR_FILES if os.path.isfile(os.path.join(src, n))]
    for n in names:
        shutil.copyfile(os.path.join(src, n), os.path.join(dst, n))
    return names


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description="Train the vlserve demo model on freshly rendered synthetic scenes.")
    p.add_argument("--out", required=True, help="output directory (a standard HF checkpoint)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="stage-2 (whole model) steps")
    p.add_argument("--vision-steps", type=int, default=DEFAULT_VISION_STEPS, help="stage-1 (vision tower) steps")
    p.add_argument("--vision-minutes", type=float, default=None, help="wall-clock cap of stage 1")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--minutes", type=float, default=40.0, help="wall-clock cap; saves when reached")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--video-prob", type=float, default=0.3)
    p.add_argument("--max-turns", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads for the model (data renders in a worker)")
    p.add_argument("--workers", type=int, default=1, help="0 renders batches in the training process")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--aux-weight", type=float, default=1.0, help="weight of the dense auxiliary losses (0: off)")
    p.add_argument(
        "--init-from",
        default=None,
        help="fine-tune: start stage 2 from this checkpoint's weights (e.g. vlserve/demo/model), skip stage "
        "1, copy its tokenizer/processor files unchanged (a lower --lr, e.g. 5e-4, keeps its forms)",
    )
    a = p.parse_args(argv)
    train(
        a.out,
        steps=a.steps,
        batch_size=a.batch_size,
        lr=a.lr,
        minutes=a.minutes,
        seed=a.seed,
        video_prob=a.video_prob,
        max_turns=a.max_turns,
        threads=a.threads,
        workers=a.workers,
        log_every=a.log_every,
        aux_weight=a.aux_weight,
        vision_steps=a.vision_steps,
        vision_minutes=a.vision_minutes,
        init_from=a.init_from,
    )


if __name__ == "__main__":
    main()
