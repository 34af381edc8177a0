"""Disaggregated serving, measured with vLLM's own bench client, on the cores this machine has:

    VP="$(../shared/tools/setup-vllm-anchor.sh | tail -1)"
    python -m benchmarks.disagg --vllm-python "$VP" --scenario pd        # 1P1D vs one server, mixed load
    python -m benchmarks.disagg --vllm-python "$VP" --scenario offload   # the KV offload tier
    python -m benchmarks.disagg --vllm-python "$VP" --scenario encoder   # the shared encoder cache

`pd`: one `vlserve serve` on every core against a prefill server and a decode server (one core each, `taskset`)
behind `vlserve proxy`: the same cores in all (`--with-vllm`: vLLM-CPU's server alone on every core too). Two `bench serve` clients run at once: short text prompts that
decode long answers at a fixed concurrency (their ITL is what P/D protects), and long image prompts arriving at a
fixed rate (random-mm). Prints TTFT and ITL p50 / p99 of both.
`offload`: vLLM's prefix_repetition load (prompts over --prefixes shared prefixes, a working set --working-set
times the device pool) on one server without and with `--kv-offloading-size`: prefix hit rate (device hits plus
tier hits over the prefix cache's queried tokens, from /metrics) and TTFT; then, in this process, the first-token time of a prompt of
each length computed afresh vs loaded back from the host tier and from the disk tier.
`encoder`: server A (ec_both) answers random-mm image requests, then a fresh server B sharing A's directory and a
plain server C get the same requests: tower runs (/metrics) and TTFT of B and C.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import httpx

from benchmarks.serve_harness import (
    ANCHOR_PYTHON,
    BENCH_CLIENT,
    Server,
    build_checkpoint,
    free_port,
    machine_kind,
    vllm_cmd,
    vllm_version,
    vlserve_cmd,
)
from vlserve.bench.anchor_env import process_tree_cores, vllm_cpu_env

NAME = "bench"


def metrics(base_url: str) -> dict[str, float]:
    """The server's /metrics samples without labels, by name."""
    out = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10, trust_env=False).text.splitlines():
        m = re.match(r"^(vlserve:[a-z0-9_]+) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def client_cmd(python: str, base_url: str, model: str, dataset: list[str], tag: str, result_dir: str) -> list[str]:
    """vLLM's `bench serve` (openai-chat) with a dataset's flags; its result JSON lands in result_dir/tag.json."""
    client = (
        [python, BENCH_CLIENT]
        if os.path.exists(BENCH_CLIENT)
        else [python, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    )
    return [
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
        NAME,
        *dataset,
        "--ignore-eos",
        "--temperature",
        "0",
        "--percentile-metrics",
        "ttft,itl",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        result_dir,
        "--result-filename",
        f"{tag}.json",
    ]


def run_clients(cmds: dict[str, list[str]], result_dir: str, timeout: float) -> dict[str, dict]:
    """Run the clients at once; each one's result JSON (an empty dict, and its log's tail printed, if it failed)."""
    procs = {}
    for tag, cmd in cmds.items():
        log = open(os.path.join(result_dir, f"{tag}.client.log"), "w")
        procs[tag] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=vllm_cpu_env()), log)
    out = {}
    for tag, (proc, log) in procs.items():
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        path = os.path.join(result_dir, f"{tag}.json")
        if proc.returncode == 0 and os.path.exists(path):
            with open(path) as f:
                out[tag] = json.load(f)
        else:
            with open(log.name, errors="replace") as f:
                print(f"[{tag}] client failed (exit {proc.returncode}):\n{f.read()[-2000:]}", flush=True)
            out[tag] = {}
    return out


def pct(result: dict, metric: str, p: int) -> float:
    return result.get(f"p{p}_{metric}_ms", result.get(f"median_{metric}_ms" if p == 50 else "", float("nan")))


class Stack:
    """Servers started together and stopped together (their logs in result_dir)."""

    def __init__(self, result_dir: str):
        self.result_dir, self.servers = result_dir, []

    def serve(
        self,
        tag: str,
        model: str,
        args,
        extra: list[str] = (),
        cores: str | None = None,
        threads: int | None = None,
        command: list[str] | None = None,
        port: int | None = None,
        env: dict | None = None,
    ) -> str:
        """Start one server (`vlserve serve`, or `command`: given its port, or one appended) and wait for it."""
        if port is None:
            port = free_port()
            cmd = (
                command + ["--port", str(port)]
                if command
                else vlserve_cmd(
                    model, NAME, port, args.dtype, args.max_model_len, {"image": 1, "video": 0}, list(extra)
                )
            )
        else:
            cmd = command
        if cores:
            cmd = ["taskset", "-c", cores, *cmd]
        env = {**(env or os.environ), **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        server = Server(cmd, port, os.path.join(self.result_dir, f"{tag}.server.log"), env)
        self.servers.append(server)
        why = server.wait_healthy(args.server_timeout)
        if why:
            raise RuntimeError(f"{tag} {why}:\n{server.log_tail()}")
        print(f"[{tag}] cores: {process_tree_cores(server.proc.pid)}", flush=True)
        return server.base_url

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for s in reversed(self.servers):
            s.stop()


def text_load(args) -> list[str]:
    return [
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.text_input_len),
        "--random-output-len",
        str(args.text_output_len),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(args.text_prompts),
        "--max-concurrency",
        str(args.text_concurrency),
        "--request-rate",
        "inf",
        "--seed",
        "1",
    ]


def image_load(args, seed: int = 2, rate: float | None = None) -> list[str]:
    s = args.image_size
    return [
        "--dataset-name",
        "random-mm",
        "--random-input-len",
        str(args.image_text_len),
        "--random-output-len",
        str(args.image_output_len),
        "--random-range-ratio",
        "0",
        "--random-mm-base-items-per-request",
        "1",
        "--random-mm-num-mm-items-range-ratio",
        "0",
        "--random-mm-limit-mm-per-prompt",
        json.dumps({"image": 1, "video": 0}),
        "--random-mm-bucket-config",
        f"{{({s}, {s}, 1): 1.0}}",
        "--num-prompts",
        str(args.image_prompts),
        "--request-rate",
        str(rate or args.image_rate),
        "--seed",
        str(seed),
    ]


def scenario_pd(model: str, args, result_dir: str) -> None:
    cores = f"0-{os.cpu_count() - 1}"
    rows = []
    layouts = ["one server", "1P1D"] + (["vLLM-CPU, one server"] if args.with_vllm else [])
    for layout in layouts:
        with Stack(result_dir) as st:
            tag = re.sub(r"[^A-Za-z0-9]+", "_", layout)
            if layout == "one server":
                url = st.serve("single", model, args, cores=cores, threads=os.cpu_count())
            elif layout.startswith("vLLM"):
                port = free_port()
                cmd = vllm_cmd(
                    args.vllm_python, model, NAME, port, args.dtype, args.max_model_len, {"image": 1, "video": 0}, []
                )
                url = st.serve(
                    "vllm", model, args, command=["taskset", "-c", cores, *cmd], port=port, env=vllm_cpu_env(cores)
                )
            else:

                def kv(role):
                    return ["--kv-transfer-config", json.dumps({"kv_connector": "P2PConnector", "kv_role": role})]

                p = st.serve("prefill", model, args, kv("kv_producer"), cores="0", threads=1)
                d = st.serve("decode", model, args, kv("kv_consumer"), cores=str(min(1, os.cpu_count() - 1)), threads=1)
                url = st.serve(
                    "proxy",
                    model,
                    args,
                    command=[
                        sys.executable,
                        "-m",
                        "vlserve.cli",
                        "proxy",
                        "--prefill",
                        p,
                        "--decode",
                        d,
                        "--log-level",
                        "warning",
                    ],
                )
            res = run_clients(
                {
                    f"{tag}.text": client_cmd(args.vllm_python, url, model, text_load(args), f"{tag}.text", result_dir),
                    f"{tag}.image": client_cmd(
                        args.vllm_python, url, model, image_load(args), f"{tag}.image", result_dir
                    ),
                },
                result_dir,
                args.client_timeout,
            )
        rows.append((layout, res[f"{tag}.text"], res[f"{tag}.image"]))
    print(
        f"\nmixed load: {args.text_prompts} text requests ({args.text_input_len} -> {args.text_output_len} tokens, "
        f"{args.text_concurrency} at a time) while {args.image_prompts} image requests ({args.image_size}px + "
        f"{args.image_text_len} tokens -> {args.image_output_len}) arrive at {args.image_rate}/s"
    )
    print(
        "| layout | text TTFT p50 / p99 ms | text ITL p50 / p99 ms | image TTFT p50 / p99 ms | text done | image "
        "done |\n|---|---|---|---|---|---|"
    )
    for layout, t, i in rows:
        print(
            f"| {layout} | {pct(t, 'ttft', 50):.0f} / {pct(t, 'ttft', 99):.0f} | {pct(t, 'itl', 50):.1f} / "
            f"{pct(t, 'itl', 99):.1f} | {pct(i, 'ttft', 50):.0f} / {pct(i, 'ttft', 99):.0f} | "
            f"{t.get('completed', 0)} | {i.get('completed', 0)} |"
        )
    if len(rows) > 2 and rows[2][1] and rows[1][1]:
        print(
            f"text ITL p99, 1P1D / vLLM-CPU one server: {pct(rows[1][1], 'itl', 99) / pct(rows[2][1], 'itl', 99):.2f}x"
        )
    if rows[0][1] and rows[1][1]:
        print(f"text ITL p99, 1P1D / one server: {pct(rows[1][1], 'itl', 99) / pct(rows[0][1], 'itl', 99):.2f}x")


def scenario_offload(model: str, args, result_dir: str) -> None:
    plen, n = args.prefix_len, args.prefixes
    working_set_blocks = n * -(-(plen + 32) // 16)
    pool = max(working_set_blocks // args.working_set, 2 * -(-(plen + 40) // 16) + 2)  # two requests at a time fit
    load = [
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        str(plen),
        "--prefix-repetition-suffix-len",
        "32",
        "--prefix-repetition-num-prefixes",
        str(n),
        "--prefix-repetition-output-len",
        "8",
        "--num-prompts",
        str(args.offload_prompts),
        "--max-concurrency",
        "2",
        "--request-rate",
        "inf",
        "--seed",
        "3",
    ]
    print(
        f"\noffload: {n} prefixes of {plen} tokens (+32), {args.offload_prompts} prompts, working set "
        f"{working_set_blocks} blocks of 16, device pool {pool} blocks"
    )
    print("| KV tiers | prefix hit rate | device hits | tier hits | TTFT p50 / p99 ms |\n|---|---|---|---|---|")
    for tier in ("device only", "device + host tier"):
        extra = ["--num-kv-blocks", str(pool), "--block-size", "16"]
        if tier != "device only":
            extra += ["--kv-offloading-size", str(args.offload_gib)]
        with Stack(result_dir) as st:
            url = st.serve("offload", model, args, extra)
            tag = "offload_" + tier.split()[-2]
            res = run_clients(
                {tag: client_cmd(args.vllm_python, url, model, load, tag, result_dir)}, result_dir, args.client_timeout
            )[tag]
            m = metrics(url)
        prompt = m.get("vlserve:prefix_cache_queries_total", 0) or float("nan")
        dev, tier_hits = m.get("vlserve:prefix_cache_hits_total", 0), m.get("vlserve:kv_offload_hit_tokens_total", 0)
        print(
            f"| {tier} | {(dev + tier_hits) / prompt:.1%} | {dev:.0f} | {tier_hits:.0f} | "
            f"{pct(res, 'ttft', 50):.0f} / {pct(res, 'ttft', 99):.0f} |"
        )
    crossover(model, args)


def crossover(model: str, args) -> None:
    """First-token time of one prompt per length: computed afresh, and loaded back from the host / disk tier."""
    import torch

    from vlserve import LLM, SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0)
    print("\n| prompt tokens | recompute ms | host tier ms | disk tier ms | host / recompute |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as disk:
        kw = dict(
            dtype=args.dtype,
            block_size=16,
            num_kv_blocks=args.crossover_max // 16 + 8,
            max_model_len=args.crossover_max + 16,
            seed=0,
        )
        host = LLM(model, kv_offloading_size=args.offload_gib, **kw)
        disk_llm = LLM(model, kv_offloading_dir=disk, **kw)
        g = torch.Generator().manual_seed(5)
        vocab = min(host.get_tokenizer().vocab_size, 30000)

        def first_token_ms(llm, ids):
            t0 = time.perf_counter()
            llm.generate({"prompt_token_ids": ids}, one, use_tqdm=False)
            return (time.perf_counter() - t0) * 1e3

        def evict(llm):  # a prompt as long as the pool: every earlier block leaves the device
            llm.generate(
                {"prompt_token_ids": torch.randint(3, vocab, (args.crossover_max,), generator=g).tolist()},
                one,
                use_tqdm=False,
            )

        for llm in (host, disk_llm):  # warm-up
            evict(llm)
        for n in (16, 64, 256, 1024, 2048, 4096):
            if n > args.crossover_max:
                break
            ids = torch.randint(3, vocab, (n + 1,), generator=g).tolist()
            fresh = first_token_ms(host, ids)  # computed, then stored in the tier
            times = []
            for llm in (host, disk_llm):
                if llm is disk_llm:
                    first_token_ms(llm, ids)
                evict(llm)
                times.append(first_token_ms(llm, ids))
            print(f"| {n} | {fresh:.1f} | {times[0]:.1f} | {times[1]:.1f} | {times[0] / fresh:.2f} |")


def scenario_encoder(model: str, args, result_dir: str) -> None:
    print(
        f"\nencoder cache: {args.image_prompts} random-mm image requests ({args.image_size}px), the same on each server"
    )
    print("| server | tower runs | TTFT p50 / p99 ms |\n|---|---|---|")
    with tempfile.TemporaryDirectory() as shared:
        ec = [
            "--ec-transfer-config",
            json.dumps(
                {
                    "ec_connector": "ECSharedStorageConnector",
                    "ec_role": "ec_both",
                    "ec_connector_extra_config": {"shared_storage_path": shared},
                }
            ),
        ]
        for tag, extra in (("A (ec_both, first)", ec), ("B (ec_both, same images)", ec), ("C (plain)", [])):
            with Stack(result_dir) as st:
                url = st.serve("encoder", model, args, extra)
                key = "encoder_" + tag[0]
                res = run_clients(
                    {key: client_cmd(args.vllm_python, url, model, image_load(args, 7, float("inf")), key, result_dir)},
                    result_dir,
                    args.client_timeout,
                )[key]
                runs = metrics(url).get("vlserve:encoder_runs_total", float("nan"))
            print(f"| {tag} | {runs:.0f} | {pct(res, 'ttft', 50):.0f} / {pct(res, 'ttft', 99):.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=ANCHOR_PYTHON, help="the anchor venv's python (vLLM's bench client)")
    p.add_argument("--scenario", choices=["pd", "offload", "encoder", "all"], default="all")
    p.add_argument("--with-vllm", action="store_true", help="pd: also vLLM-CPU's server alone under the same load")
    p.add_argument("--checkpoint-dir", default=os.path.expanduser("~/.cache/vlserve/bench"))
    p.add_argument("--vision-depth", type=int, default=8)
    p.add_argument("--vision-width", type=int, default=384)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--text-input-len", type=int, default=64)
    p.add_argument("--text-output-len", type=int, default=128)
    p.add_argument("--text-prompts", type=int, default=40)
    p.add_argument("--text-concurrency", type=int, default=4)
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--image-text-len", type=int, default=256)
    p.add_argument("--image-output-len", type=int, default=8)
    p.add_argument("--image-prompts", type=int, default=8)
    p.add_argument("--image-rate", type=float, default=0.5, help="image requests per second (pd)")
    p.add_argument("--prefix-len", type=int, default=480)
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--working-set", type=int, default=4, help="working set / device pool (offload)")
    p.add_argument("--offload-prompts", type=int, default=48)
    p.add_argument("--offload-gib", type=float, default=1.0)
    p.add_argument("--crossover-max", type=int, default=2048)
    p.add_argument("--server-timeout", type=float, default=300)
    p.add_argument("--client-timeout", type=float, default=1800)
    p.add_argument("--result-dir", default=None)
    args = p.parse_args()
    model = build_checkpoint(
        args.checkpoint_dir, args.vision_depth, args.vision_width, args.hidden_size, args.num_layers
    )
    result_dir = args.result_dir or tempfile.mkdtemp(prefix="vlserve-disagg-")
    os.makedirs(result_dir, exist_ok=True)
    print(
        f"machine: {machine_kind()}; vLLM bench client: {vllm_version(args.vllm_python)}; model: random Qwen2-VL "
        f"ViT {args.vision_depth}x{args.vision_width}, LM {args.num_layers}x{args.hidden_size}, {args.dtype}; "
        f"logs: {result_dir}",
        flush=True,
    )
    for name in ["pd", "offload", "encoder"] if args.scenario == "all" else [args.scenario]:
        {"pd": scenario_pd, "offload": scenario_offload, "encoder": scenario_encoder}[name](model, args, result_dir)


if __name__ == "__main__":
    main()
