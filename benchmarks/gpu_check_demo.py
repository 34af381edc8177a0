"""The GPU check's small-model steps (`benchmarks.gpu_check`): (g) the demo model's single stream,
(h) the encoder cache on vs off and EAGLE vs plain decoding, (j) the host's work per step on a tiny model. Each
returns the step's record (figures, headline, command); `s` is the run's size table (`gpu_check_sizes.sizes(cfg)`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time


# -- (g) the demo model, one stream ---------------------------------------------------------------------------------
def step_demo_single_stream(cfg, s):
    from vlserve import LLM, SamplingParams
    from vlserve.bench.spec_demo import conversations

    n = s["demo_tokens"]
    llm = LLM(None)
    conv = conversations(1, 4242, repeat=False)
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    llm.chat(conv, sp, use_tqdm=False)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        out = llm.chat(conv, sp, use_tqdm=False)
        best = min(best, time.perf_counter() - t)
    o = out[0]
    decode = (o.metrics.last_token_time - o.metrics.first_token_time) / max(len(o.outputs[0].token_ids) - 1, 1)
    level = llm.engine.runner.forward.level
    llm.shutdown()
    return {
        "figures": {
            "tok/s (end to end)": round(n / best, 1),
            "decode ms/token": round(1000 * decode, 3),
            "level": level,
        },
        "headline": f"{n / best:.1f} tok/s, one image conversation, {n} tokens",
        "command": f"LLM(vlserve-demo).chat(1 demo conversation with an image, max_tokens={n}, ignore_eos)",
    }


# -- (h) encoder cache and EAGLE ------------------------------------------------------------------------------------
def step_encoder_cache(cfg, s):
    from vlserve.bench import mm_cache
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    m = s["mm_cache"]
    path = os.path.join(cfg["work_dir"], f"qwen2-vl-mm-{m['vision_depth']}-{m['vision_width']}-{m['image_size']}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        px = m["image_size"] ** 2
        build_qwen2_vl_checkpoint(
            path,
            hidden_size=256,
            intermediate_size=512,
            num_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vision_depth=m["vision_depth"],
            vision_embed_dim=m["vision_width"],
            vision_num_heads=8 if m["vision_width"] >= 256 else 2,
            mrope_section=(8, 12, 12),
            initializer_range=0.02,
            max_pixels=px,
            min_pixels=(m["image_size"] // 2) ** 2,
        )
    images = mm_cache.make_images(m["num_images"], m["image_size"], 0)
    px = m["image_size"] ** 2
    kw = {"max_pixels": px, "min_pixels": px // 4}
    on = mm_cache.run(path, images, m["num_requests"], m["output_len"], True, kw)
    off = mm_cache.run(path, images, m["num_requests"], m["output_len"], False, kw)
    speed = on["req_per_s"] / off["req_per_s"]
    return {
        "figures": {
            "cache on req/s": round(on["req_per_s"], 2),
            "cache off req/s": round(off["req_per_s"], 2),
            "throughput on/off": f"{speed:.2f}x",
            "mean TTFT off/on": f"{off['mean_ttft'] / on['mean_ttft']:.2f}x",
            "encoder runs on / off": f"{on['encoder_runs']} / {off['encoder_runs']}",
            "seconds on / off": f"{on['seconds']:.2f} / {off['seconds']:.2f}",
            "of which in the HF processor, on / off": f"{on['preprocess_s']:.2f} / {off['preprocess_s']:.2f}",
            "decoder forwards on (graph replays / eager)": f"{on['graph_replays']} / {on['eager_forwards']}",
            "graphs compiled during the timed runs, on / off": f"{on['graphs_compiled']} / {off['graphs_compiled']}",
        },
        "headline": f"encoder cache {speed:.2f}x throughput",
        "command": f"python -m vlserve.bench.mm_cache --num-requests {m['num_requests']} --num-images "
        f"{m['num_images']} --image-size {m['image_size']} --vision-depth {m['vision_depth']} "
        f"--vision-width {m['vision_width']} --output-len {m['output_len']} (in process)",
    }


def step_eagle(cfg, s):
    from vlserve import LLM
    from vlserve.bench import mm_cache, spec_demo

    e = s["eagle"]
    convs = spec_demo.conversations(e["num_prompts"], 4242, repeat=False)
    # one engine at a time, as a server runs (the second GPU run held both at once: the plain engine's batch-1
    # speed then read 56.8 tok/s end to end against the lone demo engine's 0.7 ms/token)
    runs = {}
    for name, kw in (
        ("plain", {}),
        ("eagle", {"speculative_config": {"method": "eagle", "num_speculative_tokens": 4}}),
    ):
        llm = LLM(None, **kw)
        runs[name] = {bs: spec_demo.run(llm, convs, bs) for bs in e["batch_sizes"]}
        runs[name]["forwards"] = mm_cache.forward_counts(llm.get_metrics())
        llm.shutdown()
    figures, heads = {}, []
    for bs in e["batch_sizes"]:
        plain, fast = runs["plain"][bs], runs["eagle"][bs]
        x = fast["tok_s"] / plain["tok_s"]
        figures[f"batch {bs}"] = (
            f"plain {plain['tok_s']:.1f} tok/s (decode {plain['decode_tok_s']:.1f}), eagle "
            f"{fast['tok_s']:.1f} tok/s (decode {fast['decode_tok_s']:.1f}), speedup {x:.2f}x, "
            f"acceptance {fast['acceptance']:.2f}, mean accepted length "
            f"{fast['mean_accepted_len']:.2f}, identical outputs {plain['ids'] == fast['ids']}, "
            f"{plain['tokens']} tokens"
        )
        heads.append(f"batch {bs} {x:.2f}x")
    for name in runs:
        figures[f"{name} decoder forwards"] = runs[name]["forwards"]
    return {
        "figures": figures,
        "headline": "EAGLE " + ", ".join(heads),
        "command": f"python -m vlserve.bench.spec_demo --method eagle --num-prompts {e['num_prompts']} "
        f"--batch-sizes {','.join(map(str, e['batch_sizes']))} (in process, one engine at a time)",
    }


# -- (j) host work per step -----------------------------------------------------------------------------------------
def step_host_step(cfg, s):
    """`benchmarks.host_step` (a tiny model: the step is the host's work) at a large batch and at batch 1, each
    synchronous and with async scheduling; the large batch's runs also print cProfile's top functions (the log)."""
    n = s["num_prompts"]
    runs = [
        (f"batch {n}", ["--num-prompts", str(n), "--profile"]),
        ("batch 1", ["--num-prompts", "1", "--output-len-range", "128", "128"]),
    ]
    figures, commands = {}, []
    for label, extra in runs:
        for mode in ("sync", "async"):
            args = ["-m", "benchmarks.host_step", "--repeats", "2", "--top", "30", *extra]
            args += ["--async-scheduling"] if mode == "async" else []
            proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cfg["repo"])
            print(proc.stdout, proc.stderr[-2000:], flush=True)
            found = re.search(r"ms/step: wall median ([\d.]+)", proc.stdout)
            figures[f"{label}, {mode}: ms/step"] = float(found.group(1)) if found else f"exit {proc.returncode}"
            commands.append("python " + " ".join(args))
    return {
        "figures": figures,
        "command": "; ".join(commands),
        "headline": ", ".join(f"{k} {v}" for k, v in figures.items()),
    }
