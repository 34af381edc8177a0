"""Embedding throughput of vlserve's pooling runner beside HF transformers, sentence-transformers and vLLM-CPU's
pooling runner, on the same checkpoints, each runner in its own process, one run.

    python -m benchmarks.pooling                                   # both models, float32 and bfloat16
    python -m benchmarks.pooling --dtype bfloat16 --images 64 --texts 256 --models qwen2_vl
    python -m benchmarks.pooling --quick --no-vllm                 # tiny checkpoints, a few items (seconds)
    python -m benchmarks.pooling --rounds 2                        # every runner twice, each one's best round
    python -m benchmarks.pooling --ceiling                         # and the most items/s this CPU's peak allows

Checkpoints (built once under --workdir, see benchmarks/pooling_checkpoints.py): a random Qwen2-VL embedder
(ViT 8 x 512, LM 512 x 8, the real Qwen2-VL processor and a released-like chat template) and a random CLIP of
ViT-B/32's shapes with a real CLIPProcessor. Workloads, the same items for every runner: `images`, --images
synthetic pictures of mixed sizes (224x224, 320x240, 448x336 in turn; seeded), for Qwen2-VL each a GME-style
message (the image and a short instruction through the chat template, the last token pooled), for CLIP the bare
image (its processor resizes); `texts`, --texts queries of 8-32 words (Qwen2-VL: a user message through the chat
template; CLIP: the bare text). Runners: vlserve (`LLM(..., runner="pooling", convert="embed")`, CLIP by
`LLM(clip_dir)`) and vLLM-CPU (the anchor venv's `vllm.LLM`, every core bound), each embedding a workload in one
`embed` call; HF (Qwen2-VL's base model, last token of the left-padded batch; CLIPModel.get_image_features /
get_text_features) and sentence-transformers (CLIP; Qwen2-VL texts only) in batches of --hf-batch. Each runner
embeds a warm-up set of as many other items first, then the timed set. A runner that cannot serve a model prints
"not supported" with the reason instead of failing the run.

With --rounds N every runner runs N times per model and dtype, the runners' order reversed every other round, and
each runner's best round counts (this machine's speed drifts by 20-40% over minutes, unevenly across runners run
one after another). Prints one table per model and dtype: items/s per runner, vlserve / HF and vlserve / vLLM-CPU (goal: >= 2x HF,
>= 1.3x vLLM), the lowest cosine of each runner's first --check embeddings against HF's (a fast but wrong runner
shows there), and vlserve's vision-tower calls and images encoded for the timed images (fewer calls than
images: several images, of mixed sizes, packed into one call). With --ceiling, one more vlserve process per table
runs each workload's timed set under torch.profiler for the GFLOP of its linear layers (benchmarks/linear_flops.py);
that work over this CPU's arithmetic peak, measured right after (benchmarks.cpu_peak), is the most items/s any pass
doing those GEMMs can reach, printed beside the items/s the goal asks. Results and the machine's kind go to --out as JSON (default: WORKDIR/results-<time>.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import sys

from benchmarks.anchors import run_child
from benchmarks.pooling_checkpoints import WORDS, clip_checkpoint, parameter_count, qwen2_vl_embedder
from benchmarks.realsize import cpu_name
from benchmarks.serve_harness import vllm_version
from vlserve.bench.anchor_env import anchor_python

CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pooling_child.py")
LINEAR_FLOPS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "linear_flops.py")
MODELS = ("qwen2_vl", "clip")
RUNNERS = ("vlserve", "hf", "st", "vllm")
LABELS = {"vlserve": "vlserve", "hf": "HF", "st": "sentence-transformers", "vllm": "vLLM-CPU"}
IMAGE_SIZES = ((224, 224), (320, 240), (448, 336))  # (width, height), in turn
IMAGE_INSTRUCTION = "Represent the given image."
MAX_MODEL_LEN = 1024


def synthetic_image(width: int, height: int, rng: random.Random):
    """A seeded picture: a colour gradient, a few flat rectangles and some noise; uint8 [H, W, 3]."""
    import numpy as np

    y, x = np.mgrid[0:height, 0:width]
    base = [rng.uniform(0, 255) for _ in range(3)]
    image = np.stack([(base[c] + 120 * x / width + 60 * c * y / height) % 256 for c in range(3)], axis=-1)
    for _ in range(rng.randint(2, 6)):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        image[y0 : y0 + rng.randint(8, height // 2), x0 : x0 + rng.randint(8, width // 2)] = [
            rng.uniform(0, 255) for _ in range(3)
        ]
    noise = np.random.default_rng(rng.randrange(1 << 30)).normal(0, 8, image.shape)
    return np.clip(image + noise, 0, 255).astype(np.uint8)


def queries(n: int, rng: random.Random) -> list[str]:
    """n search-like queries of 8-32 words from WORDS."""
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 32))) for _ in range(n)]


def chat_prompt(tokenizer, text: str, with_image: bool) -> str:
    """Qwen2-VL's final prompt text: one user message (an image placeholder first if any), the assistant's turn open."""
    content = ([{"type": "image"}] if with_image else []) + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prepare_sets(family: str, model: str, counts: dict[str, int], workdir: str, seed: int) -> list[dict]:
    """The workloads as pooling_child.py takes them: per workload a warm-up set and the main set of other items;
    images saved as .npz under `workdir`."""
    import numpy as np

    tokenizer = None
    if family == "qwen2_vl":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
    workloads = []
    for name, n in counts.items():
        if n <= 0:
            continue
        sets = {}
        # a warm-up as large as the timed set, of other items: an engine meets the batch shapes of a steady load
        # (oneDNN builds a primitive per shape the first time; vlserve pads row counts to a few sizes)
        for set_name, size, set_seed in (("warmup", n, seed + 1), ("main", n, seed)):
            rng = random.Random(f"{name}-{set_seed}")
            if name == "images":
                images = [synthetic_image(*IMAGE_SIZES[i % len(IMAGE_SIZES)], rng) for i in range(size)]
                path = os.path.join(workdir, f"images-{set_name}-{size}-s{set_seed}.npz")
                np.savez(path, **{str(i): img for i, img in enumerate(images)})
                texts = [IMAGE_INSTRUCTION] * size
            else:
                path, texts = None, queries(size, rng)
            if family == "qwen2_vl":
                prompts = [chat_prompt(tokenizer, t, path is not None) for t in texts]
            else:
                prompts = [""] * size if path else texts
            sets[set_name] = {"prompts": prompts, "images": path}
        workloads.append({"name": name, "sets": sets})
    return workloads


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)) or 1.0)


def runner_cells(result, workload: str, hf_first: list | None) -> dict:
    """One runner's figures on one workload: items/s and its lowest cosine against HF's first embeddings, or why
    there are none."""
    if isinstance(result, str):
        return {"error": result}
    if "unsupported" in result:
        return {"error": f"not supported ({result['unsupported']})"}
    w = result["workloads"].get(workload)
    if w is None:
        return {"error": "no result"}
    cells = {k: w.get(k) for k in ("items_per_s", "seconds", "tower_calls", "images_encoded")}
    if hf_first:
        cells["min_cosine_vs_hf"] = min(cosine(a, b) for a, b in zip(w["first"], hf_first))
    return cells


def table_rows(results: dict, workloads: list[dict]) -> list[dict]:
    """Per workload: each runner's cells and vlserve's ratios to HF and vLLM-CPU."""
    rows = []
    for w in workloads:
        hf = results.get("hf")
        hf_w = hf["workloads"].get(w["name"]) if isinstance(hf, dict) and "workloads" in hf else None
        hf_first = hf_w["first"] if hf_w and "first" in hf_w else None
        cells = {r: runner_cells(res, w["name"], hf_first) for r, res in results.items()}
        row = {"workload": w["name"], "items": len(w["sets"]["main"]["prompts"]), "runners": cells}
        if hf_first and len(hf_first) > 1:  # how alike two different items are: what a wrong answer scores
            pairs = [(a, b) for i, a in enumerate(hf_first) for b in hf_first[i + 1 :]]
            row["hf_max_cosine_between_items"] = max(cosine(a, b) for a, b in pairs)
        ours = cells.get("vlserve", {}).get("items_per_s")
        for anchor in ("hf", "vllm"):
            theirs = cells.get(anchor, {}).get("items_per_s")
            row[f"vlserve_over_{anchor}"] = ours / theirs if ours and theirs else None
        rows.append(row)
    return rows


def format_table(title: str, rows: list[dict], runners: list[str]) -> str:
    """A markdown table: items/s per runner, the ratios, the cosines against HF, vlserve's tower calls."""
    head = ["workload"] + [f"{LABELS[r]} items/s" for r in runners]
    head += ["vlserve/HF", "vlserve/vLLM", "min cos vs HF (" + ", ".join(LABELS[r] for r in runners if r != "hf") + ")"]
    head += ["HF item vs item (max cos)", "vlserve tower calls / images"]
    lines = [title, "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes: dict[str, None] = {}  # one line per runner and reason
    for row in rows:
        cells = [f"{row['workload']} ({row['items']})"]
        for r in runners:
            c = row["runners"][r]
            cells.append(f"{c['items_per_s']:.2f}" if "items_per_s" in c else "-")
            if "error" in c:
                notes[f"{LABELS[r]}: {c['error']}"] = None
        cells += [f"{row[k]:.2f}x" if row[k] else "-" for k in ("vlserve_over_hf", "vlserve_over_vllm")]
        cosines = [row["runners"][r].get("min_cosine_vs_hf") for r in runners if r != "hf"]
        cells.append(" / ".join(f"{c:.5f}" if c is not None else "-" for c in cosines))
        baseline = row.get("hf_max_cosine_between_items")
        cells.append(f"{baseline:.5f}" if baseline is not None else "-")
        ours = row["runners"].get("vlserve", {})
        calls = ours.get("tower_calls") if row["workload"] == "images" else None
        cells.append(f"{calls} / {ours.get('images_encoded')}" if calls is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + list(notes))


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=RUNNERS)
    p.add_argument("--images", type=int, default=None, help="timed images per model (default 64; --quick 3)")
    p.add_argument("--texts", type=int, default=None, help="timed texts per model (default 256; --quick 4)")
    p.add_argument("--no-vllm", action="store_true", help="leave vLLM-CPU out")
    p.add_argument("--quick", action="store_true", help="tiny checkpoints of the same families, a few items")
    p.add_argument("--hf-batch", type=int, default=16, help="HF and sentence-transformers batch size")
    p.add_argument("--check", type=int, default=4, help="embeddings compared with HF's per workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=os.path.expanduser("~/.cache/vlserve-bench/pooling"))
    p.add_argument("--out", default=None, help="results JSON (default: WORKDIR/results-<time>.json)")
    p.add_argument("--vlserve-kwargs", type=json.loads, default={}, help="JSON: more vlserve.LLM arguments")
    p.add_argument("--vllm-kwargs", type=json.loads, default={}, help="JSON: more vllm.LLM arguments")
    p.add_argument("--vllm-python", default=None, help="default: the anchor venv's (installed when missing)")
    p.add_argument(
        "--ceiling",
        action="store_true",
        help="count vlserve's linear FLOPs (one more profiled pass in its last round) and print the items/s no "
        "engine can pass at this CPU's arithmetic peak beside the goal's",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per runner process")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every runner this many times per model and dtype, in alternating order; each runner's best round",
    )
    args = p.parse_args(argv)
    args.images = (3 if args.quick else 64) if args.images is None else args.images
    args.texts = (4 if args.quick else 256) if args.texts is None else args.texts
    if args.images < 0 or args.texts < 0 or args.images + args.texts == 0:
        p.error("--images and --texts must be >= 0, not both 0")
    if args.hf_batch < 1 or args.check < 1 or args.rounds < 1:
        p.error("--hf-batch, --check and --rounds must be >= 1")
    if args.no_vllm:
        args.runners = [r for r in args.runners if r != "vllm"]
    if "hf" not in args.runners:
        args.runners.insert(0, "hf")  # the ratios and the cosine check need it
    args.runners = [r for r in RUNNERS if r in args.runners]
    return args


def keep_faster(kept, new):
    """One runner's results over rounds: per workload the round with the most items/s, every round's figure under
    `rounds`; the first round's kept embeddings (the same items every round)."""
    if not (isinstance(new, dict) and "workloads" in new):
        return kept
    if not (isinstance(kept, dict) and "workloads" in kept):
        return new
    for name, w in new["workloads"].items():
        old = kept["workloads"].get(name)
        if old is None:
            kept["workloads"][name] = w
            continue
        rounds = old.get("rounds", [old["items_per_s"]]) + [w["items_per_s"]]
        if w["items_per_s"] > old["items_per_s"]:
            kept["workloads"][name] = {**w, "first": old.get("first", w.get("first"))}
        kept["workloads"][name]["rounds"] = rounds
    return kept


def ceiling_lines(rows: list[dict], ours, counted, dtype: str) -> str:
    """Per workload: vlserve's linear GFLOP over this CPU's arithmetic peak (measured now, benchmarks.cpu_peak) as
    the most items/s any pass over those FLOPs can reach, beside the items/s the goal asks (2x HF, 1.3x vLLM-CPU)."""
    import torch

    from benchmarks.cpu_peak import peak_gflops

    if dtype == "bfloat16" and torch.cpu._is_amx_tile_supported():
        return "ceiling: none (AMX tiles are not measured by benchmarks.cpu_peak)"
    peak = peak_gflops(dtype)
    if not peak:
        return f"ceiling: none (no {dtype} peak on this CPU)"
    lines = [
        f"ceiling at this CPU's peak, {peak:.0f} GFLOP/s {dtype} on {os.cpu_count()} cores, measured after the runs:"
    ]
    for row in rows:
        w = ours["workloads"].get(row["workload"], {}) if isinstance(ours, dict) and "workloads" in ours else {}
        c = (
            counted["workloads"].get(row["workload"], {})
            if isinstance(counted, dict) and "workloads" in counted
            else {}
        )
        gflop = c.get("linear_gflop")
        if not gflop or not w:
            lines.append(f"- {row['workload']}: no FLOP count ({counted if isinstance(counted, str) else 'none'})")
            continue
        ceiling = w["items"] / (gflop / peak)
        goals = {"2x HF": (row["runners"].get("hf", {}).get("items_per_s") or 0) * 2}
        goals["1.3x vLLM"] = (row["runners"].get("vllm", {}).get("items_per_s") or 0) * 1.3
        need = max(goals.values())
        verdict = "past the ceiling" if need > ceiling else f"{need / ceiling:.0%} of the ceiling"
        lines.append(
            f"- {row['workload']}: vlserve's linears {gflop:.1f} GFLOP: <= {ceiling:.2f} items/s; vlserve "
            f"{w['items_per_s']:.2f} ({w['items_per_s'] / ceiling:.0%}); the goal needs "
            + ", ".join(f"{k} {v:.2f}" for k, v in goals.items() if v)
            + f": {verdict}"
        )
    return "\n".join(lines)


def model_title(family: str, path: str, dtype: str, quick: bool) -> str:
    name = {"qwen2_vl": "Qwen2-VL embedder", "clip": "CLIP"}[family]
    shape = "tiny" if quick else {"qwen2_vl": "ViT 8x512, LM 512x8", "clip": "ViT-B/32 shapes"}[family]
    return f"{name} ({shape}; {parameter_count(path) / 1e6:.1f}M parameters), {dtype}"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    out_path = args.out or os.path.join(args.workdir, f"results-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    builders = {"qwen2_vl": qwen2_vl_embedder, "clip": clip_checkpoint}
    pythons = {r: sys.executable for r in args.runners}
    if "vllm" in args.runners:
        pythons["vllm"] = args.vllm_python or anchor_python("vllm")
    machine = cpu_name()
    versions = {"vllm": vllm_version(pythons["vllm"])} if "vllm" in pythons else {}
    print(f"machine: {machine}; {versions or 'no vLLM'}", flush=True)
    report = {"machine": machine, "versions": versions, "command": " ".join(sys.argv), "args": vars(args)}
    report["tables"] = []
    tables = []
    for family in args.models:
        model = builders[family](args.workdir, quick=args.quick)
        workloads = prepare_sets(family, model, {"images": args.images, "texts": args.texts}, args.workdir, args.seed)
        for dtype in args.dtype:
            results = {}
            order = [(r, runner) for r in range(args.rounds) for runner in args.runners[:: 1 if r % 2 == 0 else -1]]
            for round_, runner in order:
                spec = {
                    "runner": runner,
                    "family": family,
                    "model": model,
                    "dtype": dtype,
                    "max_model_len": MAX_MODEL_LEN,
                    "hf_batch": args.hf_batch,
                    "keep": args.check,
                    "engine_kwargs": {"vlserve": args.vlserve_kwargs, "vllm": args.vllm_kwargs}.get(runner, {}),
                    "workloads": workloads,
                }
                log = os.path.join(args.workdir, f"{family}-{dtype}-{runner}.log")
                print(f"[{family} {dtype}] {LABELS[runner]} round {round_ + 1} (log {log}) ...", flush=True)
                engine = "vllm" if runner == "vllm" else "vlserve"
                r = run_child(engine, pythons[runner], spec, log, args.timeout, CHILD_SCRIPT)
                results[runner] = keep_faster(results.get(runner), r)
                if isinstance(r, dict) and "unsupported" in r:
                    print(f"[{family} {dtype}] {LABELS[runner]}: not supported ({r['unsupported']})", flush=True)
                elif isinstance(r, dict):
                    print(f"[{family} {dtype}] {LABELS[runner]}: loaded in {r['load_s']:.1f} s; cores {r['cores']}")
            rows = table_rows(results, workloads)
            title = model_title(family, model, dtype, args.quick)
            table = format_table(title, rows, args.runners)
            if args.ceiling:  # one more vlserve process, its main sets under the profiler
                log = os.path.join(args.workdir, f"{family}-{dtype}-flops.log")
                spec = {
                    **spec,
                    "runner": "vlserve",
                    "count_flops": LINEAR_FLOPS_PATH,
                    "engine_kwargs": args.vlserve_kwargs,
                }
                print(f"[{family} {dtype}] vlserve's linear FLOPs (log {log}) ...", flush=True)
                counted = run_child("vlserve", sys.executable, spec, log, args.timeout, CHILD_SCRIPT)
                table += "\n" + ceiling_lines(rows, results.get("vlserve"), counted, dtype)
            tables.append(table)
            for res in results.values():  # the kept embeddings are for the cosine column only
                for w in res.get("workloads", {}).values() if isinstance(res, dict) else ():
                    w.pop("first", None)
            report["tables"].append({"model": family, "path": model, "dtype": dtype, "rows": rows, "raw": results})
    sizes = ", ".join(f"{w}x{h}" for w, h in IMAGE_SIZES)
    print(f"\nmachine: {machine}; {versions or 'no vLLM'}")
    print(f"images: {args.images} of {sizes} in turn; texts: {args.texts} queries of 8-32 words")
    print("goal: vlserve >= 2x HF and >= 1.3x vLLM-CPU")
    if args.rounds > 1:
        print(f"items/s: each runner's best of {args.rounds} rounds (runners in alternating order)")
    print()
    print("\n\n".join(tables))
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nresults: {out_path}")
    return report


if __name__ == "__main__":
    main()
