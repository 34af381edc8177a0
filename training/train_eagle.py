"""Train an EAGLE / EAGLE-3 draft head on a target's own hidden states (self-distillation).

    python -m training.train_eagle --target MODEL --data prompts.jsonl --out DRAFT_DIR [--method eagle|eagle3]

Data: JSONL, one item per line: {"prompt": "text"} or {"messages": [OpenAI chat messages]} (image parts as
{"type": "image_url", "image_url": {"url": "data:image/png;base64,..." | "file:///abs/path" | "/abs/path"}}),
or {"prompt_token_ids": [ids]}.
The last --num-eval items (default: 10%, at least 1) are held out for the acceptance report.

1. The target generates its own greedy continuation of every training item (--gen-len tokens) through the
   vlserve engine; a recorder in the proposer slot keeps, for every computed position p, the target states the
   draft reads at p, the (media-merged) embedding of token p+1, the target's final normed hidden state and the
   position. So the draft learns the target's distribution on the target's own text, images included.
2. The head (one decoder layer; the target's embeddings / final norm / lm_head are shared and frozen; fc inputs
   RMS-normalized) is trained with cross-entropy against the target's next token (its argmax by default, what
   greedy acceptance needs; --label-temperature T > 0: its softened distribution) + feature regression for
   EAGLE-1, unrolled over --ttt-steps draft steps exactly as serving runs them (EAGLE-3's training-time test).
   AdamW, warmup + cosine over --max-steps / --epochs or --time-budget seconds. Defaults suit small targets on CPU
   (lr 3e-3); lower --lr for big ones.
3. Held-out report: greedy acceptance rate (accepted / proposed drafts) and mean accepted length (tokens per
   verification step = 1 + accepted per step) of the trained head vs the same head before training (--init),
   through the engine (with both heads the outputs must be, and are checked to be, identical).
Writes DRAFT_DIR/{config.json, model.safetensors, train_report.json}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import tempfile
import time

import torch
import torch.nn.functional as F

from training.eagle_recording import Sequence, generate_items, read_items, record_target

# ------------------------------------------------------------------------------------------------ training


def _batches(seqs: list[Sequence], batch_size: int, rng: random.Random):
    order = list(range(len(seqs)))
    rng.shuffle(order)
    for i in range(0, len(order), batch_size):
        yield [seqs[j] for j in order[i : i + batch_size]]


def _pad(seqs: list[Sequence], device) -> dict[str, torch.Tensor]:
    B, L = len(seqs), max(s.hidden.shape[0] for s in seqs)
    mrope = seqs[0].positions.dim() == 2

    def stack(get, width):
        out = torch.zeros(B, L, width)
        for b, s in enumerate(seqs):
            t = get(s)
            out[b, : t.shape[0]] = t
        return out.to(device)

    pos = torch.zeros((B, 3, L) if mrope else (B, L), dtype=torch.long)
    lens = torch.tensor([s.hidden.shape[0] for s in seqs])
    for b, s in enumerate(seqs):
        pos[b, ..., : s.positions.shape[-1]] = s.positions
    return {
        "hidden": stack(lambda s: s.hidden, seqs[0].hidden.shape[1]),
        "embeds": stack(lambda s: s.embeds, seqs[0].embeds.shape[1]),
        "final": stack(lambda s: s.final, seqs[0].final.shape[1]),
        "positions": pos.to(device),
        "lens": lens.to(device),
    }


def draft_loss(
    draft,
    target_lm_head,
    batch: dict,
    ttt_steps: int,
    reg_weight: float,
    vocab_ids=None,
    noise: float = 0.0,
    label_temperature: float = 1.0,
):
    """Mean over unrolled steps (weights 0.8^t) of CE vs the target's next-token distribution at
    `label_temperature` (0: its argmax; small random targets have flat distributions whose argmax is what greedy
    acceptance needs) + EAGLE-1 feature regression. Returns (loss, top-1 agreement of step 0)."""
    hidden, embeds, final, lens = batch["hidden"], batch["embeds"], batch["final"], batch["lens"]
    B, L, _ = hidden.shape
    if noise:
        hidden = hidden + (torch.rand_like(hidden) - 0.5) * 2 * noise
    outs = draft.forward_train(embeds, hidden, batch["positions"], num_steps=ttt_steps)
    with torch.no_grad():
        tlogits = target_lm_head(final[:, 1:]).float()  # [B, L-1, V]: target at p+1 -> token p+2
        if vocab_ids is not None:
            tlogits = tlogits[..., vocab_ids]
        targmax = tlogits.argmax(-1)
        if label_temperature > 0:
            tprobs = (tlogits / label_temperature).softmax(-1)
        else:
            tprobs = F.one_hot(targmax, tlogits.shape[-1]).float()
    p = torch.arange(L - 1, device=hidden.device)
    total, wsum, acc = 0.0, 0.0, None
    for t, out in enumerate(outs):
        mask = (p[None, :] >= t) & (p[None, :] + 1 < lens[:, None])  # [B, L-1]
        if not mask.any():
            break
        o = out[:, :-1][mask]  # [N, H]
        logp = draft.logits(o).log_softmax(-1)
        ce = -(tprobs[mask] * logp).sum(-1).mean()
        loss = ce
        if reg_weight and not draft.eagle3:
            want = hidden[:, 1:][mask]
            if draft.cfg.fc_input_norm:  # only the direction of a fed-back state matters then
                o, want = _unit_rms(o), _unit_rms(want)
            loss = loss + reg_weight * F.smooth_l1_loss(o, want)
        w = 0.8**t
        total = total + w * loss
        wsum += w
        if t == 0:
            acc = (logp.argmax(-1) == targmax[mask]).float().mean().item()
    return total / wsum, acc


def _unit_rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def train_head(draft, target_lm_head, train: list[Sequence], args, device, vocab_ids=None) -> dict:
    from tqdm.auto import tqdm

    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    total = args.max_steps or args.epochs * steps_per_epoch
    warmup = min(max(1, total // 20), 100)

    def lr_at(step: int, elapsed: float) -> float:
        """Linear warmup, then cosine to 10% over the run (steps, or the time budget if that ends first)."""
        progress = step / total
        if args.time_budget:
            progress = max(progress, elapsed / args.time_budget)
        return args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))

    rng = random.Random(args.seed)
    step, t0, last = 0, time.time(), {}
    bar = tqdm(total=total, desc="train-eagle", disable=args.quiet, dynamic_ncols=True)
    draft.train()
    while step < total:
        for seqs in _batches(train, args.batch_size, rng):
            if step >= total:
                break
            if args.time_budget and time.time() - t0 > args.time_budget:
                total = step
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(step, time.time() - t0)
            batch = _pad(seqs, device)
            loss, acc = draft_loss(
                draft,
                target_lm_head,
                batch,
                args.ttt_steps,
                args.reg_weight,
                vocab_ids,
                args.noise,
                args.label_temperature,
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            last = {"loss": round(loss.item(), 4), "top1": round(acc or 0.0, 3)}
            bar.set_postfix(last)
            bar.update(1)
    bar.close()
    draft.eval()
    return {"steps": step, "seconds": round(time.time() - t0, 1), **{f"final_{k}": v for k, v in last.items()}}


# ------------------------------------------------------------------------------------------------ evaluation


def acceptance(target: str, draft_dir: str, method: str, items: list[dict], k: int, gen_len: int, args) -> dict:
    """Greedy decoding of `items` with the draft through the engine -> acceptance figures + output tokens."""
    from vlserve import LLM, SamplingParams

    llm = LLM(
        target,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        speculative_config={"method": method, "num_speculative_tokens": k, "model": draft_dir},
    )
    sp = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=args.ignore_eos)
    outs = generate_items(llm, items, sp, use_tqdm=False)
    m = llm.get_metrics()
    steps = m["vlserve:spec_decode_num_drafts_total"]
    drafted = m["vlserve:spec_decode_num_draft_tokens_total"]
    accepted = m["vlserve:spec_decode_num_accepted_tokens_total"]
    return {
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "mean_accepted_length": round(1 + accepted / steps, 3) if steps else 1.0,
        "draft_tokens": int(drafted),
        "accepted_tokens": int(accepted),
        "verify_steps": int(steps),
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }


# ------------------------------------------------------------------------------------------------ main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m training.train_eagle", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_args(p)
    return p


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of `python -m training.train_eagle` (for a CLI subparser; run it with `run(args)`)."""
    p.add_argument("--target", required=True, help="target checkpoint directory")
    p.add_argument("--data", required=True, help='JSONL of {"prompt": str} or {"messages": [...]}')
    p.add_argument("--out", required=True, help="output directory for the draft checkpoint")
    p.add_argument("--method", choices=["eagle", "eagle3"], default="eagle")
    p.add_argument("--eval-data", default=None, help="held-out JSONL (default: the last --num-eval items of --data)")
    p.add_argument("--num-eval", type=int, default=None, help="held-out items (default 10%%, at least 1)")
    p.add_argument("--gen-len", type=int, default=64, help="greedy tokens the target generates per item")
    p.add_argument("--ignore-eos", action="store_true", help="generate --gen-len tokens even past EOS")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens for the acceptance report")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    p.add_argument("--time-budget", type=float, default=None, help="stop training after this many seconds")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ttt-steps", type=int, default=3, help="draft steps unrolled in training (1 = teacher forcing)")
    p.add_argument("--reg-weight", type=float, default=0.1, help="EAGLE-1 feature regression weight")
    p.add_argument(
        "--label-temperature",
        type=float,
        default=0.0,
        help="soft labels = softmax(target logits / T); 0 = the target's argmax (hard labels)",
    )
    p.add_argument("--noise", type=float, default=0.0, help="uniform noise added to target states (EAGLE-1)")
    p.add_argument(
        "--init",
        choices=["identity", "random", "mimic"],
        default="identity",
        help="identity (eagle): random layer, fc passes the next token's embedding through (the "
        "residual stream starts like the target's); random: all random; mimic (eagle): a copy "
        "of the target's last layer. The untrained head in the report starts the same way.",
    )
    p.add_argument("--intermediate-size", type=int, default=None, help="draft MLP width (default: the target's)")
    p.add_argument("--target-layer-ids", default=None, help="eagle3: three comma-separated target layer ids")
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="eagle3: keep the most frequent target tokens only (default: the full vocabulary)",
    )
    p.add_argument("--dtype", default="float32", help="serving dtype for data generation and the report")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--data-cache",
        default=None,
        help="file that keeps the recorded target states; reused when target/data/settings match",
    )
    p.add_argument("--no-eval", action="store_true", help="skip the held-out acceptance report")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def train_eagle(args: argparse.Namespace) -> dict:
    """Everything `main` does; returns the report dict (also written to OUT/train_report.json)."""
    from transformers import AutoConfig

    from vlserve.models.loader import load_model
    from vlserve.spec_decode.eagle_checkpoint import init_eagle_weights, save_eagle_draft
    from vlserve.spec_decode.eagle_heads import copy_last_layer, eagle_config_for, target_has_qkv_bias
    from vlserve.spec_decode.eagle_model import EagleConfig, EagleDraftModel, default_eagle3_layer_ids

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    items = read_items(args.data)
    if args.eval_data:
        train_items, eval_items = items, read_items(args.eval_data)
    else:
        n_eval = args.num_eval if args.num_eval is not None else max(1, len(items) // 10)
        if n_eval >= len(items):
            raise ValueError(f"--num-eval {n_eval} leaves no training items out of {len(items)}")
        train_items, eval_items = items[: len(items) - n_eval], items[len(items) - n_eval :]

    hf_config = AutoConfig.from_pretrained(args.target)
    text_cfg = getattr(hf_config, "text_config", None) or hf_config
    L = text_cfg.num_hidden_layers
    overrides = {}
    if args.intermediate_size:
        overrides["intermediate_size"] = args.intermediate_size
    if args.method == "eagle3":
        layer_ids = (
            [int(x) for x in args.target_layer_ids.split(",")] if args.target_layer_ids else default_eagle3_layer_ids(L)
        )
        overrides["target_layer_ids"] = layer_ids
        if args.draft_vocab_size and args.draft_vocab_size < text_cfg.vocab_size:
            overrides["draft_vocab_size"] = args.draft_vocab_size
    else:
        layer_ids = [L]  # pre_norm: the final residual stream
    if args.init == "mimic":
        if args.method != "eagle":
            raise ValueError("--init mimic is for --method eagle")
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )

    # 1. the target's own continuations and states
    t0 = time.time()
    key = {
        "target": os.path.abspath(args.target),
        "method": args.method,
        "layer_ids": layer_ids,
        "gen_len": args.gen_len,
        "ignore_eos": args.ignore_eos,
        "items": train_items,
        "dtype": args.dtype,
    }
    seqs = None
    if args.data_cache and os.path.isfile(args.data_cache):
        cached = torch.load(args.data_cache, weights_only=False)
        if cached.get("key") == key:
            seqs = [Sequence(**s) for s in cached["seqs"]]
    if seqs is None:
        seqs, _ = record_target(args.target, train_items, args.gen_len, args.method, layer_ids, args)
        if args.data_cache:
            torch.save({"key": key, "seqs": [vars(s) for s in seqs]}, args.data_cache)
    if not seqs:
        raise ValueError("no usable training sequences were recorded")
    gen_seconds = time.time() - t0
    n_tokens = sum(s.hidden.shape[0] for s in seqs)

    # 2. the head
    target = load_model(args.target, hf_config, torch.float32, device)
    for prm in target.parameters():
        prm.requires_grad_(False)
    reduced = "draft_vocab_size" in overrides
    if args.init == "mimic":
        overrides.setdefault("input_layernorm", True)
        overrides.setdefault("attention_bias", target_has_qkv_bias(target))
    else:  # normalized fc inputs: the target's streams dwarf the embeddings otherwise (slow, unstable training)
        overrides.setdefault("fc_input_norm", True)
    cfg = EagleConfig.from_dict(eagle_config_for(text_cfg, args.method, **overrides))
    draft = EagleDraftModel(cfg, text_cfg, own_lm_head=reduced).to(device)
    init_eagle_weights(draft, seed=args.seed)
    draft.rotary_emb.init_buffers(device=device, dtype=torch.float32)
    draft.attach_target(target)
    if args.init == "mimic":
        copy_last_layer(draft, target)
    elif args.init == "identity" and args.method == "eagle":
        with torch.no_grad():  # x = fc([e; h]) starts as e + small noise: the target's residual stream base
            H = cfg.hidden_size
            draft.fc.weight[:, :H] += torch.eye(H, device=device)
    vocab_ids = None  # the target ids of a reduced draft vocabulary
    if reduced:
        vocab_ids = _frequent_tokens(seqs, target.lm_head, cfg.draft_vocab_size, device)
        with torch.no_grad():
            draft.lm_head.weight.copy_(target.lm_head.weight[vocab_ids])
            draft.d2t.copy_(vocab_ids - torch.arange(len(vocab_ids), device=device))
    report = {
        "method": args.method,
        "target": os.path.abspath(args.target),
        "train_items": len(train_items),
        "eval_items": len(eval_items),
        "train_sequences": len(seqs),
        "train_tokens": n_tokens,
        "generation_seconds": round(gen_seconds, 1),
        "draft_params": sum(p.numel() for p in draft.parameters()),
    }
    with tempfile.TemporaryDirectory(prefix="vlserve-eagle-untrained-") as untrained_dir:
        save_eagle_draft(draft, untrained_dir)  # the starting point: the report's untrained baseline
        report["train"] = train_head(draft, target.lm_head, seqs, args, device, vocab_ids)
        save_eagle_draft(draft, args.out)
        del target

        # 3. held-out acceptance: trained vs untrained
        if not args.no_eval:
            untrained = acceptance(args.target, untrained_dir, args.method, eval_items, args.k, args.gen_len, args)
            trained = acceptance(args.target, args.out, args.method, eval_items, args.k, args.gen_len, args)
            same = trained.pop("tokens") == untrained.pop("tokens")
            report["eval"] = {
                "k": args.k,
                "init": args.init,
                "trained": trained,
                "untrained": untrained,
                "identical_outputs": same,
            }
    with open(os.path.join(args.out, "train_report.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report


def _frequent_tokens(seqs: list[Sequence], lm_head, n: int, device) -> torch.Tensor:
    """The n target tokens most often predicted (argmax) on the training data, sorted by id."""
    counts = torch.zeros(lm_head.weight.shape[0], dtype=torch.long)
    with torch.no_grad():
        for s in seqs:
            ids = lm_head(s.final.to(device)).argmax(-1).cpu()
            counts += torch.bincount(ids, minlength=counts.numel())
    top = torch.argsort(counts, descending=True, stable=True)[:n]
    return torch.sort(top).values.to(device)


def format_report(r: dict) -> str:
    lines = [
        f"EAGLE head ({r['method']}) trained on {r['train_sequences']} sequences / {r['train_tokens']} tokens "
        f"in {r['train']['steps']} steps ({r['train']['seconds']} s; data generation "
        f"{r['generation_seconds']} s); final loss {r['train'].get('final_loss')}, "
        f"top-1 {r['train'].get('final_top1')}"
    ]
    ev = r.get("eval")
    if ev:
        lines.append(f"held-out acceptance ({r['eval_items']} items, k={ev['k']}, greedy):")
        for name in ("untrained", "trained"):
            e = ev[name]
            lines.append(
                f"  {name:9s}: acceptance rate {e['acceptance_rate']:.3f}, mean accepted length "
                f"{e['mean_accepted_length']:.2f} ({e['accepted_tokens']}/{e['draft_tokens']} drafts "
                f"accepted over {e['verify_steps']} steps)"
            )
        lines.append(f"  outputs identical with both heads: {ev['identical_outputs']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Train, print the report; exit status 0."""
    report = train_eagle(args)
    print(format_report(report))
    print(f"draft written to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m training.train_eagle ...`."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
