"""Offline throughput: vlserve vs HF `generate` (and vLLM-CPU, when a python with vLLM is given, and OpenVINO
GenAI with `--openvino`, on the same token ids) in one run.

    python -m vlserve.bench.throughput --num-prompts 64 --output-len 64 --hidden-size 1024 --num-layers 12
    vlserve bench throughput --model PATH

N prompts x M output tokens, ignore_eos, greedy, seeded, one warm-up run each, then `--repeats` timed runs of which
each engine reports its fastest (the machine's noise only ever slows a run down); prints tokens/s and ratios.
`--input-len-range` / `--output-len-range` draw each request's prompt length / max_tokens uniformly instead (like
vLLM's random dataset with a range ratio). HF `generate` runs each batch to its longest request (it cannot stop one
row early), so tokens/s counts only the tokens requested, for every engine. On CPU it ends with the roofline
(`cpu_report`): the run's matmul FLOPs at the GEMM rate and its weight/KV bytes at the read bandwidth, both measured
in this process, and each engine's share of the ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from vlserve.bench.anchor_env import CORES_PROBE, VLLM_CPU_BLOCK_SIZE, process_tree_cores, vllm_cpu_env
from vlserve.bench.openvino_anchor import OpenVinoCase, add_openvino_args, bench_openvino, openvino_python

_VLLM_SCRIPT = (
    CORES_PROBE
    + r"""
import json, sys, time
if __name__ == "__main__":
    with open(sys.argv[1]) as f:  # (a file: 256 prompts of ids outgrow one command-line argument)
        cfg = json.load(f)
    import torch
    torch.set_num_threads(cfg["threads"])
    from vllm import LLM, SamplingParams
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"],
              block_size=cfg["block_size"], max_num_seqs=cfg["num_prompts"], seed=0)
    sp = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in cfg["output_lens"]]
    prompts = [{"prompt_token_ids": p} for p in cfg["prompts"]]
    llm.generate(prompts[:2], sp[:2], use_tqdm=False)
    dt = float("inf")
    for _ in range(cfg["repeats"]):
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = min(dt, time.perf_counter() - t)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print("VLLM_RESULT " + json.dumps({"tokens": n, "seconds": dt, "cores": engine_cores()}))
"""
)


def make_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size - 1, (num_prompts, input_len), generator=g).tolist()


def random_lengths(bounds: list[int], n: int, seed: int) -> list[int]:
    """n seeded lengths drawn uniformly from [bounds[0], bounds[1]]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(bounds[0], bounds[1] + 1, (n,), generator=g).tolist()


def fastest_of(repeats: int, run):
    """`(seconds, result)` of the fastest of `repeats` calls of `run()` (the machine's noise only slows a run)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - t)
    return best, result


def bench_vlserve(
    model: str, prompts, output_lens: list[int], dtype: str, max_num_seqs: int, repeats: int = 1, **engine_kwargs
) -> tuple[float, int, float, int, float]:
    """Returns (seconds of the fastest of `repeats` timed runs, generated tokens, load seconds, engine steps of one
    run, compile seconds within the load);
    `engine_kwargs` go to LLM (compilation_config, enforce_eager, async_scheduling, ...). On CUDA also prints GPU
    busy and the roofline."""
    from vlserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        max_model_len=max(len(p) for p in prompts) + max(output_lens) + 16,
        **engine_kwargs,
    )
    load = time.perf_counter() - t0
    sp = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:2], sp[:2], use_tqdm=False)  # warm-up
    steps0 = llm.engine.num_steps
    dt, outs = fastest_of(repeats, lambda: llm.generate(prompts, sp, use_tqdm=False))
    steps = (llm.engine.num_steps - steps0) // repeats
    runner = llm.engine.runner  # None when the ranks run in worker processes (tensor parallel)
    if runner is not None and runner.device.type == "cuda":
        from vlserve.bench.gpu_report import print_gpu_report

        print_gpu_report(llm, prompts, sp, dt, steps)
    compile_s = runner.forward.compile_seconds if runner is not None else 0.0
    m = llm.get_metrics()
    print(
        f"decoder forwards: {int(m['vlserve:cuda_graph_replays_total'])} CUDA graph replays, "
        f"{int(m['vlserve:eager_forwards_total'])} without a graph (all runs, warm-up included)"
    )
    if runner is not None and runner.defer_readback:  # async scheduling: how many input ids never waited for the host
        print(
            f"deferred read-back: {runner.token_feed.num_fed_tokens} input ids taken on the device from the step "
            f"before's samples"
        )
    llm.shutdown()
    return dt, sum(len(o.outputs[0].token_ids) for o in outs), load, steps, compile_s


def bench_hf(
    model: str, prompts, output_lens: list[int], dtype: str, batch_size: int, repeats: int = 1, device: str = "auto"
) -> tuple[float, int, int]:
    """HF generate, batched with left padding; each batch runs to its longest request, on `device` ("auto": where
    vlserve's LLM runs by default, the GPU when there is one). Returns (seconds of the fastest of `repeats` runs,
    requested tokens, generated tokens): only the requested ones count for tokens/s."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from vlserve.engine.model_setup import pick_device

    dev = pick_device(device)
    torch_dtype = torch.bfloat16 if dtype in ("bfloat16", "bf16") else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).eval().to(dev)

    def run(batch, lens):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=dev)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=dev)
        cfg = GenerationConfig(
            max_new_tokens=max(lens), min_new_tokens=max(lens), do_sample=False, eos_token_id=None, pad_token_id=0
        )
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, generation_config=cfg)  # [B, width + max(lens)]
        if dev.type == "cuda":
            torch.cuda.synchronize()
        new = out.shape[1] - width
        return sum(min(n, new) for n in lens), new * len(batch)

    run(prompts[:2], output_lens[:2])  # warm-up
    best, counts = fastest_of(
        repeats,
        lambda: [
            run(prompts[i : i + batch_size], output_lens[i : i + batch_size])
            for i in range(0, len(prompts), batch_size)
        ],
    )
    return best, sum(c[0] for c in counts), sum(c[1] for c in counts)


def bench_vllm(
    python: str,
    model: str,
    prompts,
    output_lens: list[int],
    dtype: str,
    repeats: int = 1,
    block_size: int | None = None,
) -> tuple[float, int] | None:
    """vLLM's offline LLM.generate in its own process (its python); returns (seconds of the fastest of `repeats`
    runs, generated tokens)."""
    cfg = {
        "model": model,
        "dtype": dtype,
        "output_lens": output_lens,
        "prompts": prompts,
        "repeats": repeats,
        "block_size": block_size or VLLM_CPU_BLOCK_SIZE,
        "num_prompts": len(prompts),
        "max_model_len": max(len(p) for p in prompts) + max(output_lens) + 16,
        "threads": torch.get_num_threads(),
    }
    env = vllm_cpu_env()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(_VLLM_SCRIPT)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as c:
        json.dump(cfg, c)
    proc = subprocess.run([python, f.name, c.name], capture_output=True, text=True, env=env, timeout=1800)
    os.unlink(c.name)
    os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            r = json.loads(line[len("VLLM_RESULT ") :])
            print(f"vLLM-CPU cores (VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}): {r['cores']}")
            return r["seconds"], r["tokens"]
    print(f"vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
    return None


def build_random_model(args) -> str:
    from vlserve.demo.checkpoints import build_text_checkpoint

    out = os.path.join(tempfile.mkdtemp(prefix="vlserve-bench-"), "model")
    heads = getattr(args, "num_heads", None) or max(args.hidden_size // 64, 1)
    kv_heads = getattr(args, "num_kv_heads", None) or max(heads // 4, 1)
    build_text_checkpoint(
        out,
        arch="qwen2",
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=getattr(args, "intermediate_size", None) or args.hidden_size * 3,
        initializer_range=0.02,
        seed=args.seed,
        tokenizer_dir=getattr(args, "tokenizer", None),
    )
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local checkpoint; default: a random Qwen2 of --hidden-size/--num-layers")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=None, help="random model's query heads (default hidden / 64)")
    p.add_argument("--num-kv-heads", type=int, default=None, help="its KV heads (default heads / 4)")
    p.add_argument("--intermediate-size", type=int, default=None, help="its MLP width (default 3 x hidden)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--hf-batch-size", type=int, default=None, help="default: all prompts in one batch")
    p.add_argument("--vllm-python", help="python of a venv with vLLM (e.g. from shared/tools/setup-vllm-anchor.sh)")
    add_openvino_args(p)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs per engine after its warm-up; each engine reports its fastest (default 3)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads for both engines (default: torch's)")
    p.add_argument(
        "--input-len-range",
        type=int,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="random prompt lengths in [MIN, MAX] instead of --input-len (HF then pads)",
    )
    p.add_argument(
        "--output-len-range",
        type=int,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="random max_tokens per request in [MIN, MAX] instead of --output-len",
    )
    p.add_argument("--async-scheduling", action="store_true", help="vlserve plans step N+1 while step N runs")
    p.add_argument(
        "-O",
        "--compilation-config",
        default=None,
        help="vlserve's compilation level 0..3 or a JSON object (default: the device's)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="vlserve without torch.compile / CUDA graphs")
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"KV block size of both engines (default: vlserve's 16, vLLM-CPU's smallest, "
        f"{VLLM_CPU_BLOCK_SIZE}); the prefix cache reuses whole blocks only",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="vlserve's ranks; above 1 a one-rank vlserve run comes first, in the same process, for the ratio",
    )
    p.add_argument(
        "--compare-eager",
        action="store_true",
        help="also run vlserve with enforce_eager first, in the same process, and print the ratio",
    )
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or build_random_model(args)
    from transformers import AutoConfig

    from vlserve.config import EngineArgs
    from vlserve.models.hf_config import text_config_of

    cfg = AutoConfig.from_pretrained(model)
    text_cfg = text_config_of(cfg)  # a VLM's (the demo model's) vocab and sizes live in its text_config
    if args.input_len_range:
        lens = random_lengths(args.input_len_range, args.num_prompts, args.seed + 1)
        prompts = [make_prompts(1, n, text_cfg.vocab_size, args.seed + i)[0] for i, n in enumerate(lens)]
    else:
        prompts = make_prompts(args.num_prompts, args.input_len, text_cfg.vocab_size, args.seed)
    output_lens = [args.output_len] * args.num_prompts
    if args.output_len_range:
        output_lens = random_lengths(args.output_len_range, args.num_prompts, args.seed + 2)
    print(
        f"model: {model} ({cfg.architectures[0]}, hidden {text_cfg.hidden_size}, "
        f"{text_cfg.num_hidden_layers} layers, {text_cfg.num_attention_heads} heads / "
        f"{getattr(text_cfg, 'num_key_value_heads', None) or text_cfg.num_attention_heads} KV heads, "
        f"intermediate {text_cfg.intermediate_size}), "
        f"{args.num_prompts} prompts x {args.input_len_range or args.input_len} in -> "
        f"{args.output_len_range or args.output_len} out, "
        f"{args.dtype}, "
        f"{torch.get_num_threads()} threads, each engine the fastest of {args.repeats} timed runs"
    )
    print(f"vlserve cores: {torch.get_num_threads()} torch threads; {process_tree_cores()}")
    per_stream = max(output_lens)  # ms/token of one stream = seconds / its tokens (the longest one)
    engine_kwargs = dict(
        compilation_config=args.compilation_config,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
    )
    if args.block_size:
        engine_kwargs["block_size"] = args.block_size
    if args.compare_eager:
        edt, en, eload, esteps, _ = bench_vlserve(
            model,
            prompts,
            output_lens,
            args.dtype,
            args.num_prompts,
            args.repeats,
            **{**engine_kwargs, "enforce_eager": True},
        )
        print(
            f"vlserve eager: {en / edt:8.1f} tok/s  ({en} tokens in {edt:.2f} s, {esteps} steps, "
            f"{1000 * edt / esteps:.2f} ms/step; load {eload:.1f} s)"
        )
    tp = args.tensor_parallel_size
    if tp > 1:
        tdt, tn, tload, tsteps, _ = bench_vlserve(
            model, prompts, output_lens, args.dtype, args.num_prompts, args.repeats, **engine_kwargs
        )
        print(
            f"vlserve TP=1: {tn / tdt:8.1f} tok/s  ({tn} tokens in {tdt:.2f} s, {tsteps} steps, "
            f"{1000 * tdt / tsteps:.2f} ms/step; load {tload:.1f} s)"
        )
    dt, n, load, steps, compile_s = bench_vlserve(
        model,
        prompts,
        output_lens,
        args.dtype,
        args.num_prompts,
        args.repeats,
        tensor_parallel_size=tp,
        **engine_kwargs,
    )
    print(
        f"vlserve: {n / dt:8.1f} tok/s, {1000 * dt / per_stream:.2f} ms/token per stream  ({n} tokens in "
        f"{dt:.2f} s, {steps} steps, {1000 * dt / steps:.2f} ms/step; load {load:.1f} s incl. compile "
        f"{compile_s:.1f} s; compilation {args.compilation_config or 'default'}"
        f"{', enforce_eager' if args.enforce_eager else ''}; async_scheduling={args.async_scheduling}; "
        f"block size {args.block_size or EngineArgs.block_size}"
        f"{f'; TP={tp}' if tp > 1 else ''})"
    )
    rates = {"vlserve": n / dt}
    if args.compare_eager:
        print(f"ratio vlserve/vlserve-eager: {(n / dt) / (en / edt):.2f}x")
    if tp > 1:
        print(f"ratio vlserve TP={tp}/TP=1: {(n / dt) / (tn / tdt):.2f}x")
    if not args.skip_hf:
        hdt, hn, generated = bench_hf(
            model, prompts, output_lens, args.dtype, args.hf_batch_size or args.num_prompts, args.repeats
        )
        extra = f"; it generated {generated}, {generated / hdt:.1f} tok/s" if generated != hn else ""
        print(
            f"HF generate: {hn / hdt:8.1f} tok/s, {1000 * hdt / per_stream:.2f} ms/token per stream  "
            f"({hn} tokens in {hdt:.2f} s{extra}; on {'cuda' if torch.cuda.is_available() else 'cpu'})"
        )
        print(f"ratio vlserve/HF: {(n / dt) / (hn / hdt):.2f}x")
        rates["HF"] = hn / hdt
    if args.vllm_python:
        r = bench_vllm(args.vllm_python, model, prompts, output_lens, args.dtype, args.repeats, args.block_size)
        if r is not None:
            vdt, vn = r
            print(
                f"vLLM: {vn / vdt:8.1f} tok/s, {1000 * vdt / per_stream:.2f} ms/token per stream  "
                f"({vn} tokens in {vdt:.2f} s; block size {args.block_size or VLLM_CPU_BLOCK_SIZE})"
            )
            print(f"ratio vlserve/vLLM: {(n / dt) / (vn / vdt):.2f}x")
            rates["vLLM"] = vn / vdt
    ov_python = openvino_python(args)
    if ov_python:
        case = OpenVinoCase("all", prompts, output_lens)
        r = bench_openvino(
            ov_python, model, args.dtype, [case], args.repeats, args.openvino_export_dir, threads=args.threads
        )
        if r is not None:
            odt, on = r["cases"]["all"].seconds, r["cases"]["all"].tokens
            per_token = 1000 * odt / per_stream
            print(
                f"OpenVINO GenAI: {on / odt:8.1f} tok/s, {per_token:.2f} ms/token per stream  ({on} tokens in {odt:.2f} s)"
            )
            print(f"ratio vlserve/OpenVINO: {(n / dt) / (on / odt):.2f}x")
            rates["OpenVINO"] = on / odt
    if not torch.cuda.is_available():
        from vlserve.bench.cpu_report import cpu_roofline, format_roofline

        # the fastest of several runs repeats prompts the engines' prefix caches hold
        cached = [len(p) - 1 for p in prompts] if args.repeats > 1 else None
        print(
            format_roofline(cpu_roofline(text_cfg, [len(p) for p in prompts], output_lens, args.dtype, cached), rates)
        )


if __name__ == "__main__":
    main()
