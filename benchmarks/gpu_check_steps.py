"""The steps of `benchmarks.gpu_check`, each run in a process of its own:

    python -m benchmarks.gpu_check_steps NAME --config JSON --result PATH

A step function takes the run's config (`dry_run`, `work_dir`, `repo`) and returns `{"figures": {...}, "notes": [...],
"headline": str, "status": "pass" | "fail", "command": str}`; an exception is a failed step. Sizes: `SIZES` (CUDA)
and `DRY` (CPU, tiny: the same code paths in seconds), in `gpu_check_sizes`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback

from benchmarks.gpu_check_sizes import LEVELS, sizes


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _vocab(path: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).vocab_size


def _checkpoint(cfg: dict, key: str, **kw) -> str:
    """A random Qwen2 checkpoint of `sizes(cfg)[key]` in the work dir, built once (config.json marks it done)."""
    import torch

    from vlserve.demo.checkpoints import build_text_checkpoint

    shape = {**sizes(cfg)[key], **kw}
    name = f"{key}-" + "-".join(f"{v}" for v in shape.values())
    path = os.path.join(cfg["work_dir"], name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        dtype = torch.bfloat16 if sizes(cfg)["dtype"] == "bfloat16" and key == "model" else torch.float32
        build_text_checkpoint(path + ".tmp", arch="qwen2", dtype=dtype, **shape)
        os.replace(path + ".tmp", path)
    return path


# -- (a) the CUDA subset of the tests -------------------------------------------------------------------------------
def _per_test_limit(seconds: int = 60) -> list[str]:
    """pytest-timeout's per-test limit where the plugin is installed: a test stuck in Python (a kernel that compiles
    for minutes, a wait) fails with its stack printed and the run goes on, instead of eating the step's whole limit
    (the third GPU run lost its last ~400 tests that way)."""
    import importlib.util

    return ["--timeout", str(seconds)] if importlib.util.find_spec("pytest_timeout") else []


def step_pytest(cfg, selection: str = "pytest", per_test_s: int = 60):
    # -v -rfE: each test's name and verdict reach the log as it ends, so a run killed at its limit still shows
    # which tests failed and where it stopped; the durations show what ate the time
    args = [
        sys.executable,
        "-m",
        "pytest",
        "-v",
        "-rfE",
        "--durations=15",
        "-p",
        "no:cacheprovider",
        *_per_test_limit(per_test_s),
        *sizes(cfg)[selection],
    ]
    proc = subprocess.Popen(args, cwd=cfg["repo"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line.rstrip("\n"))
    proc.wait()
    summary = next(
        (line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|failed|error)", line)),
        "no summary line",
    )
    notes = [] if not cfg["dry_run"] else ["dry run: a handful of fast CPU tests stand in for the CUDA subset"]
    return {
        "figures": {"summary": summary, "exit code": proc.returncode},
        "headline": summary,
        "notes": notes,
        "status": "pass" if proc.returncode == 0 else "fail",
        "command": " ".join(["python", *args[1:]]),
    }


# -- (b) kernels vs torch SDPA --------------------------------------------------------------------------------------
def step_kernel_sweep(cfg):
    import torch

    from benchmarks import paged_attention as pa

    dev = torch.device(device())
    triton = dev.type == "cuda"
    dtype = torch.bfloat16 if triton else torch.float32
    if cfg["dry_run"]:  # tiny cases, the torch path only (the Triton kernels need CUDA here)
        pa.DECODE_CASES = [(2, 64, False), (2, 64, True)]
        pa.PREFILL_CASES = [(1, 0, 32), (1, 32, 16)]
    iters = 2 if cfg["dry_run"] else 20
    figures, key = {}, "triton" if triton else "torch"
    with torch.inference_mode():
        decode = pa.bench_decode(dtype, dev, iters, triton)
        prefill = pa.bench_prefill(dtype, dev, iters, triton)
    for r in decode + prefill:
        figures[f"{r['case']}: {key} / SDPA"] = f"{r[key]:.3f} ms / {r['sdpa']:.3f} ms = {r[key] / r['sdpa']:.2f}x"
    command = f"benchmarks.paged_attention bench_decode + bench_prefill ({dtype}, {dev}, {iters} iters); "
    # flash SDPA prefill (its default shapes) through benchmarks.prefill_attention
    args = [sys.executable, "-m", "benchmarks.prefill_attention"]
    args += ["--device", "cpu", "--cases", "1x32", "--iters", "1"] if cfg["dry_run"] else ["--iters", "20"]
    env = {**os.environ, "TRITON_INTERPRET": "1"} if cfg["dry_run"] else dict(os.environ)
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=cfg["repo"])
    print(proc.stdout, proc.stderr[-3000:])
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and re.match(r"\d+ x \d+", cells[0]):
            figures[f"prefill {cells[0]}: Triton paged / flash SDPA"] = (
                f"{cells[3]} ms ({cells[4]} TFLOP/s) vs {cells[1]} ms ({cells[2]} TFLOP/s): {cells[5]} of flash"
            )
    command += "python " + " ".join(args[1:])
    ratios = [r[key] / r["sdpa"] for r in decode + prefill]
    return {
        "figures": figures,
        "command": command,
        "status": "pass" if proc.returncode == 0 else "fail",
        "headline": f"{key}/SDPA {min(ratios):.2f}x..{max(ratios):.2f}x (paged); flash prefill: "
        f"{'ok' if proc.returncode == 0 else 'failed'}",
        "notes": ["dry run: torch path vs SDPA on CPU, prefill_attention under TRITON_INTERPRET"]
        if cfg["dry_run"]
        else [
            f"paged cases: per call inside a CUDA graph of {pa.GRAPH_CALLS} calls; timed "
            f"call by call: {', '.join(sorted(set(pa.EAGER_ON_CUDA))) or 'none'}"
        ],
    }


# -- (c) chunked prefill under async scheduling vs an eager synchronous run -----------------------------------------
def step_chunked_race(cfg):
    import torch

    from vlserve import LLM, SamplingParams

    s = sizes(cfg)
    model = _checkpoint(cfg, "race")
    vocab = _vocab(model)
    g = torch.Generator().manual_seed(7)
    long = torch.randint(3, vocab - 1, (s["race_prompt"],), generator=g).tolist()
    short = [torch.randint(3, vocab - 1, (n,), generator=g).tolist() for n in (5, 17, 40)]
    prompts = [long, *short]  # short requests decode while the long one prefills chunk by chunk
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common = dict(
        dtype="float32", max_num_batched_tokens=s["race_chunk"], max_num_seqs=8, max_model_len=s["race_prompt"] + 64
    )

    def ids(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    ref_llm = LLM(model, enforce_eager=True, **common)
    ref = ids(ref_llm)
    ref_llm.shutdown()
    llm = LLM(model, async_scheduling=True, **common)  # the device default: -O2 (compiled + CUDA graphs) on CUDA
    level = llm.engine.runner.forward.level
    runs = [ids(llm) for _ in range(s["race_repeats"])]
    llm.shutdown()
    same = [r == ref for r in runs]
    chunks = -(-s["race_prompt"] // s["race_chunk"])
    return {
        "figures": {
            "prompt": f"{s['race_prompt']} tokens in {chunks} chunks of {s['race_chunk']}, with 3 short "
            f"requests decoding alongside",
            "async level": level,
            "runs equal to eager sync": f"{sum(same)}/{len(same)}",
        },
        "status": "pass" if all(same) else "fail",
        "headline": f"{sum(same)}/{len(same)} async -O{level} runs == eager sync ({chunks} chunks)",
        "command": f"LLM(async_scheduling=True, max_num_batched_tokens={s['race_chunk']}) vs "
        f"LLM(enforce_eager=True), float32, greedy",
    }


# -- (d) recompiles (the driver counts TORCH_LOGS=recompiles lines) -------------------------------------------------
def step_recompiles_mrope(cfg):
    import numpy as np
    from PIL import Image

    from vlserve import LLM, SamplingParams
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    path = os.path.join(cfg["work_dir"], "qwen2-vl-mrope")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_qwen2_vl_checkpoint(
            path,
            hidden_size=128,
            intermediate_size=256,
            num_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            mrope_section=(4, 6, 6),
        )
    level = 1 if cfg["dry_run"] else 2
    llm = LLM(path, dtype="float32", compilation_config=level, max_num_seqs=8)
    rng = np.random.default_rng(0)
    img = [Image.fromarray(rng.integers(0, 255, (s, s, 3), dtype=np.uint8)) for s in (56, 112, 84)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    n = 0
    for round_ in range(2):  # text only, one image, images of other sizes, mixed batches of 1..3
        outs = llm.generate(["hello there", "a longer text prompt " * 3], sp, use_tqdm=False)
        outs += llm.generate(
            [f"Describe {i}." for i in range(3)], sp, images=[[img[i]] for i in range(3)], use_tqdm=False
        )
        outs += llm.generate(["What is it?", "plain text"], sp, images=[[img[round_]], []], use_tqdm=False)
        n += sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()
    return {
        "figures": {"level": level, "tokens": n},
        "headline": f"M-RoPE Qwen2-VL at -O{level}",
        "command": f"LLM(qwen2-vl, compilation_config={level}) text, image and mixed batches, twice",
    }


def step_recompiles_async(cfg):
    import torch

    from vlserve import LLM, SamplingParams

    model = _checkpoint(cfg, "race")
    level = 1 if cfg["dry_run"] else 2
    llm = LLM(
        model,
        dtype="float32",
        compilation_config=level,
        async_scheduling=True,
        max_num_seqs=16,
        max_num_batched_tokens=64,
    )
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, _vocab(model) - 1, (n,), generator=g).tolist() for n in (1, 3, 17, 40, 95, 160)]
    n = 0
    for max_tokens in (4, 19):
        outs = llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False
        )
        n += sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()
    return {
        "figures": {"level": level, "tokens": n},
        "headline": f"async scheduling at -O{level}, chunked",
        "command": f"LLM(compilation_config={level}, async_scheduling=True, "
        f"max_num_batched_tokens=64), prompts of 1..160 tokens",
    }


# -- (e) throughput / single stream / GPU busy on the ~1.2B Qwen2 ---------------------------------------------------
def step_build_model(cfg):
    t = time.perf_counter()
    path = _checkpoint(cfg, "model")
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path)
    params = (
        c.num_hidden_layers
        * (
            c.hidden_size
            * (c.num_attention_heads + 2 * c.num_key_value_heads)
            * (c.hidden_size // c.num_attention_heads)
            + c.hidden_size**2
            + 3 * c.hidden_size * c.intermediate_size
        )
        + c.vocab_size * c.hidden_size
    )
    return {
        "figures": {"path": path, "parameters": f"{params / 1e6:.1f} M", "seconds": round(time.perf_counter() - t, 1)},
        "headline": f"{params / 1e6:.0f}M-parameter Qwen2 ({sizes(cfg)['dtype']})",
        "command": f"build_text_checkpoint(arch='qwen2', {sizes(cfg)['model']})",
    }


def _prompts(cfg, path):
    from vlserve.bench.throughput import make_prompts

    s = sizes(cfg)
    return make_prompts(s["num_prompts"], s["input_len"], _vocab(path), 0)


def step_throughput(cfg, name):
    import torch

    from vlserve import LLM, SamplingParams
    from vlserve.bench.throughput import fastest_of

    s = sizes(cfg)
    level, use_async = LEVELS[name]
    path = _checkpoint(cfg, "model")
    prompts = _prompts(cfg, path)
    t = time.perf_counter()
    llm = LLM(
        path,
        dtype=s["dtype"],
        max_num_seqs=s["num_prompts"],
        compilation_config=level,
        async_scheduling=use_async,
        max_model_len=s["input_len"] + max(s["output_len"], s["single_len"]) + 16,
    )
    load = time.perf_counter() - t
    sp = SamplingParams(temperature=0.0, max_tokens=s["output_len"], ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    steps0 = llm.engine.num_steps
    dt, outs = fastest_of(1, lambda: llm.generate(prompts, sp, use_tqdm=False))
    steps = llm.engine.num_steps - steps0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    one = SamplingParams(temperature=0.0, max_tokens=s["single_len"], ignore_eos=True)
    llm.generate(prompts[:1], one, use_tqdm=False)
    sdt, _ = fastest_of(2, lambda: llm.generate(prompts[:1], one, use_tqdm=False))
    runner = llm.engine.runner
    figures = {
        "throughput tok/s": round(n / dt, 1),
        "tokens": n,
        "seconds": round(dt, 3),
        "steps": steps,
        "ms/step": round(1000 * dt / max(steps, 1), 3),
        "single-stream tok/s": round(s["single_len"] / sdt, 1),
        "single-stream ms/token": round(1000 * sdt / s["single_len"], 3),
        "load s": round(load, 1),
        "compile s": round(runner.forward.compile_seconds, 1),
        "resolved level": runner.forward.level,
        "CUDA graphs": runner.forward.uses_cuda_graphs,
    }
    if torch.cuda.is_available():
        from vlserve.bench.gpu_report import gpu_busy_fraction

        kernel_s, wall = gpu_busy_fraction(lambda: llm.generate(prompts, sp, use_tqdm=False))
        figures["GPU busy %"] = round(100 * kernel_s / wall, 1)
        kernel_s, wall = gpu_busy_fraction(lambda: llm.generate(prompts[:1], one, use_tqdm=False))
        figures["single-stream GPU busy %"] = round(100 * kernel_s / wall, 1)
    if runner.defer_readback:  # async scheduling: input ids the device took from the step before's samples
        figures["device-fed input ids"] = runner.token_feed.num_fed_tokens
    llm.shutdown()
    busy = f", GPU busy {figures['GPU busy %']}%" if "GPU busy %" in figures else ""
    return {
        "figures": figures,
        "headline": f"{figures['throughput tok/s']} tok/s, single stream {figures['single-stream tok/s']} tok/s{busy}",
        "command": f"python -m vlserve.bench.throughput --model {path} -O {level}"
        f"{' --async-scheduling' if use_async else ''} --num-prompts {s['num_prompts']} --input-len "
        f"{s['input_len']} --output-len {s['output_len']} --dtype {s['dtype']} (in process; plus "
        f"1 x {s['single_len']} tokens)",
    }


# -- (f) HF generate on the same device -----------------------------------------------------------------------------
def step_hf_generate(cfg):
    from vlserve.bench.throughput import bench_hf

    s = sizes(cfg)
    path = _checkpoint(cfg, "model")
    prompts = _prompts(cfg, path)
    dev = device()
    dt, n, _ = bench_hf(path, prompts, [s["output_len"]] * len(prompts), s["dtype"], len(prompts), device=dev)
    print(f"HF batched: {n} tokens in {dt:.2f} s", flush=True)  # a run killed at its limit shows how far it got
    sdt, n1, _ = bench_hf(path, prompts[:1], [s["single_len"]], s["dtype"], 1, device=dev)
    print(f"HF single stream: {n1} tokens in {sdt:.2f} s", flush=True)
    return {
        "figures": {
            "throughput tok/s": round(n / dt, 1),
            "tokens": n,
            "seconds": round(dt, 3),
            "single-stream tok/s": round(n1 / sdt, 1),
            "device": dev,
        },
        "headline": f"HF generate {n / dt:.1f} tok/s, single stream {n1 / sdt:.1f} tok/s",
        "command": f"vlserve.bench.throughput.bench_hf on {dev}, {s['dtype']}, batch {len(prompts)} x "
        f"{s['input_len']} -> {s['output_len']}; 1 x {s['single_len']}",
    }


def _demo_steps():
    from benchmarks import gpu_check_demo  # the demo-model steps, loaded when one runs

    return gpu_check_demo


def _step(name, what, budget, dry_budget, fn, **extra):
    return {"name": name, "what": what, "budget": (budget, dry_budget), "fn": fn, **extra}


# name, what it checks, (CUDA seconds, dry-run seconds), function. Order: the cheap and the correctness checks
# first, so a run that runs out of time loses figures rather than verdicts.
# The throughput and EAGLE limits are for a fresh machine (inductor's cache cold): in the third run `-O2` was
# still capturing its first graph at 75 s, and EAGLE's second engine at 79 s.
STEPS = [
    _step(
        "pytest_cuda",
        "(a) the CUDA subset of the tests: kernels, worker (compile, graphs), async scheduling, "
        "LoRA graphs, GPU report",
        300,
        60,
        step_pytest,
    ),
    _step(
        "kernel_sweep",
        "(b) Triton paged decode / prefill vs torch SDPA (paged_attention.py) and the Triton "
        "prefill vs flash SDPA (prefill_attention.py)",
        60,
        40,
        step_kernel_sweep,
    ),
    _step(
        "chunked_prefill_race",
        "(c) a long prompt in many chunks under async scheduling at the device default "
        "level, repeated: output equal to an eager synchronous run",
        75,
        30,
        step_chunked_race,
    ),
    _step(
        "recompiles_mrope",
        "(d) TORCH_LOGS=recompiles lines for an M-RoPE (Qwen2-VL) run, compiled",
        60,
        60,
        step_recompiles_mrope,
        env={"TORCH_LOGS": "recompiles"},
        count_recompiles=True,
        max_recompiles=7,
    ),
    _step(
        "recompiles_async",
        "(d) TORCH_LOGS=recompiles lines for an async-scheduling run, compiled",
        45,
        45,
        step_recompiles_async,
        env={"TORCH_LOGS": "recompiles"},
        count_recompiles=True,
        max_recompiles=7,
    ),
    _step(
        "build_model",
        "(e) the ~1.2B Qwen2 (hidden 2048, 24 layers, 16/4 heads, MLP 6144), random, bf16",
        60,
        20,
        step_build_model,
    ),
    *[
        _step(
            name,
            f"(e) throughput (256 prompts x 128 -> 128), single stream (1 x 256) and GPU busy at "
            f"-O{lvl}{' with --async-scheduling' if a else ''}",
            120,
            45,
            lambda cfg, n=name: step_throughput(cfg, n),
        )
        for name, (lvl, a) in LEVELS.items()
    ],
    _step("hf_generate", "(f) HF generate on the same device, same prompts (the baseline)", 90, 20, step_hf_generate),
    _step(
        "demo_single_stream",
        "(g) the demo model (vlserve-demo), one stream",
        90,
        20,
        lambda cfg: _demo_steps().step_demo_single_stream(cfg, sizes(cfg)),
    ),
    _step(
        "encoder_cache",
        "(h) encoder cache on vs off (vlserve.bench.mm_cache)",
        90,
        30,
        lambda cfg: _demo_steps().step_encoder_cache(cfg, sizes(cfg)),
    ),
    _step(
        "eagle",
        "(h) EAGLE (the demo's shipped head) vs plain decoding (vlserve.bench.spec_demo)",
        150,
        30,
        lambda cfg: _demo_steps().step_eagle(cfg, sizes(cfg)),
    ),
    _step(
        "host_step",
        "(j) host work per step on a tiny model, batch 256 and 1, synchronous and async (where it goes: "
        "cProfile in the log)",
        150,
        90,
        lambda cfg: _demo_steps().step_host_step(cfg, sizes(cfg)),
    ),
    _step(
        "parity_cuda",
        "(i) greedy parity with HF, one test per family, every engine at -O2 (compiled, CUDA graphs on a GPU)",
        300,
        90,
        lambda cfg: step_pytest(cfg, "parity", per_test_s=180),
        env={"VLSERVE_DEFAULT_COMPILE_LEVEL": "2"},
    ),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=[s["name"] for s in STEPS])
    p.add_argument("--config", required=True, help="the run's config as JSON")
    p.add_argument("--result", required=True, help="where to write the step's result (JSON)")
    a = p.parse_args(argv)
    cfg = json.loads(a.config)
    fn = next(s["fn"] for s in STEPS if s["name"] == a.name)
    try:
        result = fn(cfg)
        code = 0
    except Exception as exc:  # the step failed: the driver records it and goes on
        traceback.print_exc()
        result = {
            "status": "fail",
            "notes": [f"{type(exc).__name__}: {str(exc)[:300]}"],
            "headline": f"{type(exc).__name__}",
        }
        code = 1
    with open(a.result, "w") as f:
        json.dump(result, f, default=str)
    # the step's engines are shut down already; skip the interpreter's teardown (inductor's compile workers, CUDA),
    # which once outlived a step's limit after its result was written (chunked_prefill_race, second GPU run)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
