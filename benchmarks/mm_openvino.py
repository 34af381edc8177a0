"""OpenVINO GenAI beside `benchmarks.mm_serve`'s servers: it has no OpenAI server, so it runs each image workload
offline — the checkpoint's OpenVINO IR in its ContinuousBatchingPipeline (benchmarks/anchor_child.py), the same
number of requests, one distinct random image of the workload's size each with ~--input-len text tokens through the
checkpoint's chat template, --output-len tokens out (greedy, ignore_eos), at most --max-concurrency running at once
— and reports its req/s and output tok/s in the shape of the served rows, labelled offline.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from benchmarks.anchors import run_child
from benchmarks.realsize_workloads import prepare_image_workload
from benchmarks.serve_harness import Workload
from vlserve.bench.openvino_anchor import OPENVINO_LABEL, openvino_export

OFFLINE_SERVER = f"{OPENVINO_LABEL} (offline)"


def offline_unsupported(w: Workload) -> str | None:
    """Why the offline run cannot do workload `w` the way the servers do, or None when it can."""
    if w.modality != "image":
        return "not run: the offline run sends images only"
    if w.items != 1 or w.height != w.width:
        return "not run: the offline run sends one square image a request"
    return None


def offline_inputs(w: Workload, model: str, args, out_dir: str):
    """The workload's requests for the offline run (`realsize_workloads.PreparedWorkload`): --num-prompts final
    prompts with a random w.width square image each, and sets of the same shapes for the warm-up and first pass."""
    from transformers import AutoProcessor

    os.makedirs(out_dir, exist_ok=True)
    shape = SimpleNamespace(requests=args.num_prompts, image_size=w.width, seed=args.seed)
    shape.image_text_tokens, shape.max_tokens = args.input_len, args.output_len
    return prepare_image_workload(AutoProcessor.from_pretrained(model), out_dir, shape)


def run_offline(w: Workload, model: str, args, python: str, result_dir: str) -> tuple[dict, int | None, str]:
    """(metrics in the shape of vLLM's result JSON — completed, failed, request_throughput, output_throughput —
    or {} when it did not run; the mean prompt tokens, media included; a note) of OpenVINO GenAI's offline run."""
    why = offline_unsupported(w)
    if why:
        return {}, None, why
    prepared = offline_inputs(w, model, args, os.path.join(result_dir, f"{w.name}-openvino-inputs"))
    try:
        ir_dir = openvino_export(model, args.dtype, args.openvino_export_dir, python)
    except RuntimeError as err:
        return {}, None, f"export failed: {str(err)[:200]}"
    spec = {
        "model": ir_dir,
        "dtype": args.dtype,
        "max_model_len": prepared.max_model_len,
        "max_num_seqs": args.max_concurrency,
        "workloads": [prepared.child_spec()],
    }
    log = os.path.join(result_dir, f"{w.name}-openvino.log")
    print(f"[{w.name}-openvino] offline run of {prepared.describe()} (log {log}) ...", flush=True)
    r = run_child("openvino", python, spec, log)
    if isinstance(r, str):
        return {}, None, r
    res = r["workloads"][prepared.name]
    if any(n != args.output_len for n in res["output_tokens"]):
        return {}, None, f"outputs of {res['output_tokens']} tokens, expected {args.output_len} each"
    n, seconds = len(res["output_tokens"]), res["total_s"]
    metrics = {
        "completed": n,
        "failed": 0,
        "request_throughput": n / seconds,
        "output_throughput": sum(res["output_tokens"]) / seconds,
    }
    print(f"[{w.name}-openvino] cores: {r['cores']}", flush=True)
    ttft = res["engine_mean_ttft_s"]
    note = f"all requests submitted at once, at most {args.max_concurrency} running"
    note += f"; its mean TTFT {1e3 * ttft:,.1f} ms" if ttft else ""
    return metrics, round(sum(res["prompt_tokens"]) / n), note
