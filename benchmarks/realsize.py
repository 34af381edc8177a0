"""CPU serving at the size users run: a random Qwen2-VL with Qwen2-VL-2B's shapes through vlserve, vLLM-CPU and
OpenVINO GenAI, offline, each engine in its own process, one after another, against this machine's limits.

    python -m benchmarks.realsize                                  # the full measurement (tens of minutes)
    python -m benchmarks.realsize --tiny --requests 2 --text-requests 2 --image-size 112 --max-tokens 4 \\
        --text-len 8 --dtypes bfloat16 --engines vlserve           # a smoke run of the plumbing

The checkpoint (built once under --workdir, bf16 safetensors): the vision tower of depth 32, width 1280, 16 heads,
MLP ratio 4, patch 14, 2x2 merge into 1536; the LM of 1536 x 28 layers, 12 heads, 2 KV heads, MLP 8960, vocabulary
151,936, tied embeddings, M-RoPE sections 16/24/24; Qwen2-VL's processor classes and a chat template like the
released one's (`--tiny` / `--config-override` change the sizes). Workloads, the same strings and images for every
engine: `image`, --requests requests of one distinct random --image-size square image and ~60 text tokens ->
--max-tokens; `text`, --text-requests prompts of exactly --text-len tokens -> --text-len. Greedy, ignore_eos; each
engine's output token counts are checked. Per engine and workload: a warm-up, a max_tokens=1 pass on a second set of
the same shapes (its wall time is the "TTFT" column: all requests submitted at once, the last first token), then the
timed pass on the main set; decode tok/s = the tokens after the first / (timed - TTFT pass). The machine's limits
(GEMM rate per dtype, read bandwidth) are measured first; the work (see benchmarks/realsize_work.py) at those limits
gives each phase's ideal time and each engine its fraction of it. Results also go to --out as JSON.

    python -m benchmarks.realsize --quantized W8A8_DIR --vlserve-kwargs '{"mm_encoder_quantization": "int8"}'

compares the engines' quantized configurations instead (bfloat16 only; see benchmarks/realsize_quant.py): vlserve and
vLLM-CPU on W8A8_DIR, a compressed-tensors W8A8 copy of the checkpoint this run builds (`examples/
quantize_llmcompressor.py CHECKPOINT W8A8_DIR --scheme W8A8`), OpenVINO GenAI on the checkpoint's int8-weight export.
Its fractions of the ideal time are against the bf16 work and limits, as without --quantized.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys

from benchmarks.anchors import ENGINE_LABELS, ENGINES, run_child
from benchmarks.realsize_quant import (
    QUANTIZED_DTYPE,
    check_same_model,
    check_w8a8_checkpoint,
    engine_checkpoint,
    quantized_labels,
)
from benchmarks.realsize_table import format_table, result_rows
from benchmarks.realsize_work import WorkloadWork, measure_limits
from benchmarks.realsize_workloads import prepare_workloads
from vlserve.bench.anchor_env import anchor_python

# Qwen2-VL-2B-Instruct's shapes, as build_qwen2_vl_checkpoint's arguments; its processor's pixel bounds
QWEN2_VL_2B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vision_depth=32,
    vision_embed_dim=1280,
    vision_num_heads=16,
    mrope_section=[16, 24, 24],
    tie_word_embeddings=True,
    initializer_range=0.02,
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 1280,
    text_overrides={"vocab_size": 151936, "rope_theta": 1000000.0, "max_position_embeddings": 32768},
    vision_overrides={"mlp_ratio": 4},
    dtype="bfloat16",
)
# The same family at a size a smoke test runs in seconds (vocabulary and ratios kept)
TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vision_depth=2,
    vision_embed_dim=128,
    vision_num_heads=2,
    mrope_section=[8, 12, 12],
)
WORKLOADS = ("image", "text")


def checkpoint_spec(tiny: bool, override: dict | None) -> dict:
    """build_qwen2_vl_checkpoint's arguments: Qwen2-VL-2B's, then --tiny's, then --config-override's."""
    return {**QWEN2_VL_2B, **(TINY if tiny else {}), **(override or {})}


def build_checkpoint(workdir: str, spec: dict) -> str:
    """The random checkpoint of `spec` under `workdir` (built once; later runs reuse it); returns its path."""
    from tests.support.chat_templates import QWEN2_VL_CHAT_TEMPLATE
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(workdir, f"qwen2-vl-{spec['num_layers']}x{spec['hidden_size']}-{key}")
    if os.path.exists(os.path.join(path, ".complete")):
        return path
    print(f"building the checkpoint in {path} ...", flush=True)
    args = {**spec, "mrope_section": tuple(spec["mrope_section"])}
    build_qwen2_vl_checkpoint(path, variant="qwen2_vl", chat_template=QWEN2_VL_CHAT_TEMPLATE, **args)
    open(os.path.join(path, ".complete"), "w").close()
    return path


def cpu_name() -> str:
    """lscpu's model name, with the vector extensions and core count that matter here."""
    from benchmarks.serve_harness import machine_kind

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    except OSError:
        model = "?"
    return f"{model} ({machine_kind()})"


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=os.path.expanduser("~/.cache/vlserve-bench/realsize"))
    p.add_argument("--out", default=None, help="results JSON (default: WORKDIR/results-<time>.json)")
    p.add_argument(
        "--dtypes", default=None, help="default: bfloat16,float32 (with --quantized: bfloat16, the only one)"
    )
    p.add_argument("--engines", default=",".join(ENGINES), help=f"a subset of {','.join(ENGINES)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"a subset of {','.join(WORKLOADS)}")
    p.add_argument("--requests", type=int, default=8, help="image workload: requests")
    p.add_argument("--image-size", type=int, default=448, help="image workload: the images' side in pixels")
    p.add_argument("--image-text-tokens", type=int, default=60, help="image workload: text tokens beside the image")
    p.add_argument("--max-tokens", type=int, default=32, help="image workload: output tokens")
    p.add_argument("--text-requests", type=int, default=32, help="text workload: prompts")
    p.add_argument("--text-len", type=int, default=128, help="text workload: prompt and output tokens")
    p.add_argument("--tiny", action="store_true", help="a tiny checkpoint of the same family (smoke runs)")
    p.add_argument("--config-override", type=json.loads, default=None, help="JSON of checkpoint-builder args")
    p.add_argument("--gemm-size", type=int, default=4096, help="side of the square matmul measuring the GEMM rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quantized",
        default=None,
        metavar="DIR",
        help="a compressed-tensors W8A8 copy of the checkpoint: vlserve and vLLM run it, OpenVINO int8 weights",
    )
    for engine, what in (("vlserve", "vlserve.LLM arguments, e.g. '{\"compilation_config\": 1}'"),
                         ("vllm", "vllm.LLM arguments"), ("openvino", "OpenVINO properties")):  # fmt: skip
        p.add_argument(f"--{engine}-kwargs", type=json.loads, default={}, help=f"JSON: more {what}")
    p.add_argument("--vllm-python", default=None, help="default: the anchor venv's (installed when missing)")
    p.add_argument("--openvino-python", default=None, help="default: the anchor venv's (installed when missing)")
    args = p.parse_args(argv)
    args.dtypes = (args.dtypes or (QUANTIZED_DTYPE if args.quantized else "bfloat16,float32")).split(",")
    args.engines = args.engines.split(",")
    args.workloads = args.workloads.split(",")
    for name, chosen, allowed in (
        ("--dtypes", args.dtypes, ("bfloat16", "float32")),
        ("--engines", args.engines, ENGINES),
        ("--workloads", args.workloads, WORKLOADS),
    ):
        if not chosen or any(c not in allowed for c in chosen):
            p.error(f"{name} must be a comma-separated subset of {','.join(allowed)}")
    if args.quantized:
        if args.dtypes != [QUANTIZED_DTYPE]:
            p.error(f"--quantized runs {QUANTIZED_DTYPE} activations only: --dtypes must be {QUANTIZED_DTYPE}")
        try:
            check_w8a8_checkpoint(args.quantized)
        except ValueError as e:
            p.error(str(e))
    return args


def engine_python(engine: str, args) -> str:
    if engine == "vlserve":
        return sys.executable
    given = args.vllm_python if engine == "vllm" else args.openvino_python
    return given or anchor_python(engine)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    out_path = args.out or os.path.join(args.workdir, f"results-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    spec = checkpoint_spec(args.tiny, args.config_override)
    model = build_checkpoint(args.workdir, spec)
    if args.quantized:
        check_same_model(model, args.quantized)
    labels = quantized_labels(args.vlserve_kwargs) if args.quantized else dict(ENGINE_LABELS)
    workloads = prepare_workloads(model, args)
    limits = measure_limits(args.dtypes, args.gemm_size)
    machine = cpu_name()
    print(f"machine: {machine}; {limits.describe()}\ncheckpoint: {model}", flush=True)
    if args.quantized:
        print(f"quantized: {', '.join(labels[e] for e in args.engines)}; W8A8 copy: {args.quantized}", flush=True)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    pythons = {engine: engine_python(engine, args) for engine in args.engines}
    max_len = max(w.max_model_len for w in workloads.values())
    results: dict = {}
    for dtype in args.dtypes:
        for engine in args.engines:
            export_dir = os.path.join(args.workdir, "openvino")
            engine_model = engine_checkpoint(engine, model, args.quantized, dtype, export_dir, pythons[engine])
            child_spec = {
                "model": engine_model,
                "dtype": dtype,
                "max_model_len": max_len,
                "max_num_seqs": max(w.requests for w in workloads.values()),
                "workloads": [w.child_spec() for w in workloads.values()],
                "engine_kwargs": getattr(args, f"{engine}_kwargs"),
            }
            log = os.path.join(args.workdir, f"{engine}-{dtype}{'-quantized' if args.quantized else ''}.log")
            print(f"[{dtype}] {labels[engine]} on {engine_model} (log {log}) ...", flush=True)
            results[(dtype, engine)] = run_child(engine, pythons[engine], child_spec, log)
            r = results[(dtype, engine)]
            if isinstance(r, dict):
                print(f"[{dtype}] {labels[engine]}: loaded in {r['load_s']:.1f} s; cores {r['cores']}")
    work = {
        (name, dtype): WorkloadWork.of(config, w.prompt_lens, w.max_tokens, w.grids, 2 if dtype == "bfloat16" else 4)
        for name, w in workloads.items()
        for dtype in args.dtypes
    }
    rows = result_rows(results, workloads, work, limits, labels)
    print(f"\nmachine: {machine}; {limits.describe()}")
    for w in workloads.values():
        print(f"workload {w.name}: {w.describe()}")
    print(format_table(rows))
    if args.quantized:
        print(
            "quantized engines: 'vs faster anchor' is against the faster quantized peer; the ideal times and fractions "
            "are the bf16 work at this machine's bf16 GEMM rate and read bandwidth (as for the bf16 rows)"
        )
    report = {
        "machine": machine,
        "limits": {"gemm_gflops": limits.gemm_gflops, "read_gbs": limits.read_gbs, "gemm_size": limits.gemm_size},
        "checkpoint": {"path": model, "spec": spec, "quantized": args.quantized},
        "labels": labels,
        "workloads": {name: w.describe() for name, w in workloads.items()},
        "work": {f"{n}/{d}": wk.as_dict() for (n, d), wk in work.items()},
        "engines": {f"{d}/{e}": r for (d, e), r in results.items()},
        "rows": rows,
        "command": " ".join(sys.argv),
    }
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"results: {out_path}")
    return report


if __name__ == "__main__":
    main()
