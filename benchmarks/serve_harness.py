"""What `benchmarks.mm_serve` drives: its random Qwen2-VL checkpoint, servers as subprocesses, the two clients.

`build_checkpoint` writes (once per size, under a cache directory) a random Qwen2-VL with the real Qwen2-VL processor
classes and a chat template that behaves like the released checkpoints'. `Server` starts `vlserve serve` or vLLM's
OpenAI server on a free port with its log in a file, waits for /health and stops it. `run_vllm_client` runs vLLM's
own `bench serve` client (random-mm dataset) with the anchor's python; `run_vlserve_client` runs
`vlserve.bench.serve`'s client. Both return the metrics in the shape of vLLM's result JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from vlserve.bench.anchor_env import VLLM_CPU_BLOCK_SIZE, VLLM_PYTHON, vllm_cpu_env

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_CLIENT = os.path.join(os.path.dirname(REPO_ROOT), "shared", "tools", "vllm-bench-client.py")
ANCHOR_PYTHON = VLLM_PYTHON
# The Qwen2-VL processor's usual bounds: 4 to 1280 merged tokens per image; 896x896 stays 1024 tokens, unresized.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280


@dataclass(frozen=True, slots=True)
class Workload:
    """`items` random images of height x width per request, or, with frames > 1, videos of that many frames."""

    name: str
    height: int
    width: int
    items: int = 1
    frames: int = 1

    @property
    def modality(self) -> str:
        return "video" if self.frames > 1 else "image"

    @property
    def sampled_frames(self) -> int:
        """Frames vLLM serves of one of vLLM's random 30 fps clips: transformers' Qwen2-VL video processor keeps
        2 per second, at least 4 (vlserve keeps every frame unless told `num_frames`)."""
        return min(self.frames, max(int(self.frames / 30 * 2), 4)) if self.frames > 1 else 1

    def mm_tokens(self) -> int:
        """Placeholder tokens Qwen2-VL gives the request's media (sides multiples of 28, within the pixel bounds)."""
        per_frame = (self.height // 28) * (self.width // 28)
        return self.items * -(-self.sampled_frames // 2) * per_frame


def build_checkpoint(
    cache_dir: str, vision_depth: int, vision_width: int, hidden_size: int, num_layers: int, seed: int = 0
) -> str:
    """A random Qwen2-VL of these sizes in `cache_dir` (built once; later calls reuse it); returns its path.

    LM heads of 64 dims (kv heads a quarter, as the throughput bench's Qwen2), MLP 3 x hidden, M-RoPE split
    t/h/w = 1/4, 3/8, 3/8 of head_dim / 2 (Qwen2-VL's 16/24/24 of 64); vision heads of 64 dims; weights float32.
    """
    from tests.support.chat_templates import QWEN2_VL_CHAT_TEMPLATE
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    path = os.path.join(cache_dir, f"qwen2-vl-vit{vision_depth}x{vision_width}-lm{num_layers}x{hidden_size}-s{seed}")
    done = os.path.join(path, ".complete")
    if os.path.exists(done):
        return path
    heads = max(hidden_size // 64, 1)
    half = hidden_size // heads // 2
    hw = (half - half // 4) // 2
    build_qwen2_vl_checkpoint(
        path,
        variant="qwen2_vl",
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        vision_depth=vision_depth,
        vision_embed_dim=vision_width,
        vision_num_heads=max(vision_width // 64, 1),
        mrope_section=(half - 2 * hw, hw, hw),
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        initializer_range=0.02,
        seed=seed,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )
    open(done, "w").close()
    return path


def wait_healthy(proc: subprocess.Popen, base_url: str, timeout: float) -> str | None:
    """None once `base_url`/health answers 200; else why not (`proc` exited with its code, or timed out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with code {proc.returncode}"
        try:
            if httpx.get(f"{base_url}/health", timeout=2, trust_env=False).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return f"not healthy after {timeout:.0f} s"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An OpenAI-compatible server subprocess on 127.0.0.1:`port`, stdout and stderr in `log_path`."""

    def __init__(self, cmd: list[str], port: int, log_path: str, env: dict[str, str] | None = None):
        self.port, self.log_path = port, log_path
        self.base_url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env or os.environ.copy(),
            start_new_session=True,
        )

    def wait_healthy(self, timeout: float) -> str | None:
        """None once /health answers 200; else why not (exited with its code, or timed out)."""
        return wait_healthy(self.proc, self.base_url, timeout)

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM its process group (the servers' engine processes are in it); once the server has exited (or
        after 60 s), SIGKILL whatever of the group is left."""
        self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        self._signal_group(signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def vlserve_cmd(
    model: str, name: str, port: int, dtype: str, max_model_len: int, limits: dict[str, int], extra: list[str]
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vlserve.cli",
        "serve",
        model,
        "--served-model-name",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--limit-mm-per-prompt",
        json.dumps(limits),
        "--log-level",
        "warning",
        *extra,
    ]


def vllm_cmd(
    python: str,
    model: str,
    name: str,
    port: int,
    dtype: str,
    max_model_len: int,
    limits: dict[str, int],
    extra: list[str],
) -> list[str]:
    # --runner generate: vLLM 0.32 resolved this checkpoint to a pooling runner without it (docs/benchmarks.md)
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--block-size",
        str(VLLM_CPU_BLOCK_SIZE),
        "--runner",
        "generate",
        "--limit-mm-per-prompt",
        json.dumps(limits),
        *extra,
    ]


def run_vllm_client(
    python: str, base_url: str, model: str, name: str, w: Workload, args, result_dir: str, tag: str
) -> tuple[dict | None, str]:
    """vLLM's `bench serve` (openai-chat, random-mm) with `python`; (its result JSON or None, its output tail)."""
    client = (
        [python, BENCH_CLIENT]
        if os.path.exists(BENCH_CLIENT)
        else [python, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    )
    limits = {"image": w.items if w.modality == "image" else 0, "video": w.items if w.modality == "video" else 0}
    filename = f"{tag}.json"
    cmd = [
        *client,
        "--backend",
        "openai-chat",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/chat/completions",
        "--model",
        model,
        "--served-model-name",
        name,
        "--dataset-name",
        "random-mm",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--random-range-ratio",
        "0",
        "--random-mm-base-items-per-request",
        str(w.items),
        "--random-mm-num-mm-items-range-ratio",
        "0",
        "--random-mm-limit-mm-per-prompt",
        json.dumps(limits),
        "--random-mm-bucket-config",
        f"{{({w.height}, {w.width}, {w.frames}): 1.0}}",
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(args.max_concurrency),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(args.seed),
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        result_dir,
        "--result-filename",
        filename,
    ]
    with open(os.path.join(result_dir, f"{tag}.client.log"), "w") as log:
        try:
            rc = subprocess.run(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=vllm_cpu_env(),
                cwd=REPO_ROOT,
                timeout=args.client_timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {args.client_timeout:.0f} s"
    with open(log.name, errors="replace") as f:
        tail = "".join(line for line in f.readlines() if "leaked" not in line and "nanobind" not in line)
    path = os.path.join(result_dir, filename)
    if rc != 0 or not os.path.exists(path):
        return None, f"{tail[-3000:]}\n(exit: {rc})"
    with open(path) as f:
        return json.load(f), tail


def run_vlserve_client(base_url: str, name: str, w: Workload, args) -> tuple[dict | None, str]:
    """`vlserve.bench.serve`'s client (PNG data URLs, a prompt of `input_len` words, one warm-up request), its
    summary mapped onto vLLM's result keys. Images only."""
    import argparse

    from vlserve.bench import serve

    words = random.Random(args.seed).choices(
        ["red", "blue", "cat", "tree", "sky", "road", "house", "boat"], k=args.input_len
    )
    ns = argparse.Namespace(
        base_url=base_url,
        model=name,
        api_key=None,
        num_prompts=args.num_prompts,
        request_rate=float("inf"),
        max_concurrency=args.max_concurrency,
        num_images=w.items,
        image_width=w.width,
        image_height=w.height,
        prompt=" ".join(words),
        max_tokens=args.output_len,
        ignore_eos=True,
        timeout=args.client_timeout,
        seed=args.seed,
    )
    asyncio.run(serve.run(argparse.Namespace(**{**vars(ns), "num_prompts": 1})))  # warm-up
    s = asyncio.run(serve.run(ns))
    if not s["completed"]:
        return None, "no request completed"
    return {
        "completed": s["completed"],
        "failed": s["failed"],
        "request_throughput": s["request_throughput"],
        "output_throughput": s["output_tokens_per_s"],
        "median_ttft_ms": s["ttft_ms"][50],
        "p99_ttft_ms": s["ttft_ms"][99],
        "p99_itl_ms": s["itl_ms"][99],
    }, ""


def machine_kind() -> str:
    """'AVX-512' or 'AVX2-only' (or 'no AVX2'), plus AMX when present, from /proc/cpuinfo's flags."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "unknown (no /proc/cpuinfo)"
    kind = "AVX-512" if "avx512f" in flags else "AVX2-only" if "avx2" in flags else "no AVX2"
    extras = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return f"{kind}{' + ' + ', '.join(extras) if extras else ''}, {os.cpu_count()} cores"


def vllm_version(python: str) -> str:
    proc = subprocess.run(
        [python, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        env=vllm_cpu_env(),
        timeout=300,
    )
    return (
        proc.stdout.strip().splitlines()[-1]
        if proc.returncode == 0 and proc.stdout.strip()
        else f"unknown ({proc.stderr.strip()[-200:]})"
    )
