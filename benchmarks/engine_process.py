"""The engine core in its own process vs in a thread of the API process, under the same load, in one run.

    python -m benchmarks.engine_process /path/to/ckpt --num-prompts 64 --max-tokens 64 --num-images 0

Starts `vlserve serve MODEL` twice on free ports (once with `--no-engine-process`), drives each with
`vlserve.bench.serve` (all prompts at once: 64 concurrent streams by default), and prints both throughputs and
their ratio. Without MODEL it builds a tiny random Qwen2 checkpoint in a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile

from benchmarks.serve_harness import free_port, wait_healthy
from vlserve.bench import serve as serve_bench


def _start_server(model: str, port: int, engine_process: bool, extra: list[str]) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "vlserve.cli",
        "serve",
        model,
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--log-level",
        "warning",
        *extra,
    ]
    if not engine_process:
        cmd.append("--no-engine-process")
    proc = subprocess.Popen(cmd)
    why = wait_healthy(proc, f"http://127.0.0.1:{port}", 600)
    if why:
        proc.kill()
        raise RuntimeError(f"server {why}: {' '.join(cmd)}")
    return proc


def run_one(args, engine_process: bool) -> dict:
    """Start a server in the given mode, warm it up, run the load, stop it; the bench summary."""
    port = free_port()
    proc = _start_server(args.model, port, engine_process, args.server_args)
    try:
        load = argparse.Namespace(
            base_url=f"http://127.0.0.1:{port}",
            model="bench",
            api_key=None,
            num_prompts=args.num_prompts,
            request_rate=float("inf"),
            max_concurrency=None,
            num_images=args.num_images,
            image_width=args.image_size,
            image_height=args.image_size,
            prompt=args.prompt,
            max_tokens=args.max_tokens,
            ignore_eos=True,
            timeout=600.0,
            seed=args.seed,
        )
        asyncio.run(serve_bench.run(argparse.Namespace(**{**vars(load), "num_prompts": 4})))  # warm-up
        print(f"--- engine {'process' if engine_process else 'thread'} ---")
        return asyncio.run(serve_bench.run(load))
    finally:
        proc.terminate()
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine_process",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: a tiny random Qwen2)")
    p.add_argument("--hidden-size", type=int, default=64, help="of the random checkpoint built without MODEL")
    p.add_argument("--num-layers", type=int, default=2, help="of the random checkpoint built without MODEL")
    p.add_argument("--num-prompts", type=int, default=64, help="all sent at once: this many concurrent streams")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-images", type=int, default=0)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--prompt", default="Tell me a story about the sea.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--server-args",
        nargs=argparse.REMAINDER,
        default=["--dtype", "float32"],
        help="passed to both `vlserve serve` runs (last option; default: --dtype float32)",
    )
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from vlserve.demo.checkpoints import build_text_checkpoint

            args.model = build_text_checkpoint(
                os.path.join(tmp, "ckpt"),
                arch="qwen2",
                hidden_size=args.hidden_size,
                num_layers=args.num_layers,
                num_heads=8,
                num_kv_heads=2,
                intermediate_size=args.hidden_size * 3,
            )
        thread = run_one(args, engine_process=False)
        process = run_one(args, engine_process=True)
    print("=== summary ===")
    for name, s in (("engine thread", thread), ("engine process", process)):
        print(
            f"{name:15s} {s['output_tokens_per_s']:9.1f} tok/s  {s['request_throughput']:6.2f} req/s  "
            f"TTFT p50 {s['ttft_ms'][50]:8.1f} ms  ITL p50 {s['itl_ms'][50]:7.1f} ms  failed {s['failed']}"
        )
    ratio = process["output_tokens_per_s"] / thread["output_tokens_per_s"] if thread["output_tokens_per_s"] else 0
    print(f"process / thread output throughput: {ratio:.2f}x")
    return 0 if not thread["failed"] and not process["failed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
