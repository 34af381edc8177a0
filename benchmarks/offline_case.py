"""One offline generation case in its own process: vlserve, vLLM-CPU or transformers' generate on one checkpoint,
greedy with every output `output_len` tokens long, the fastest of `repeats` runs after a warm-up, for each batch
size; plus the process's peak RSS. Shared by the quantization and MoE benchmarks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from vlserve.bench.anchor_env import CORES_PROBE, vllm_cpu_env
from vlserve.bench.throughput import build_random_model, make_prompts

_CASE = r"""
import json, resource, sys, time
if __name__ == "__main__":  # vLLM spawns its engine core: the script must be importable
    cfg = json.loads(sys.argv[1])
    import torch
    torch.set_num_threads(cfg["threads"])
    if cfg["engine"] == "hf":  # transformers' own generate, batched (equal-length prompts: no padding)
        import transformers
        auto = transformers.AutoConfig.from_pretrained(cfg["model"])
        cls = (transformers.AutoModelForImageTextToText if hasattr(auto, "vision_config")
               else transformers.AutoModelForCausalLM)
        model = cls.from_pretrained(cfg["model"], dtype=getattr(torch, cfg["dtype"])).eval()
        result = {}
        for batch in cfg["batches"]:
            ids = torch.tensor(cfg["prompts"][:batch])
            kw = dict(max_new_tokens=cfg["output_len"], min_new_tokens=cfg["output_len"], do_sample=False)
            with torch.inference_mode():
                model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)
                best = float("inf")
                for _ in range(cfg["repeats"]):
                    t = time.perf_counter()
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
                    best = min(best, time.perf_counter() - t)
            result[str(batch)] = (out.shape[1] - ids.shape[1]) * batch / best
        result["rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
        print("CASE_CORES " + json.dumps(engine_cores()))
        print("CASE_RESULT " + json.dumps(result))
        sys.exit(0)
    if cfg["engine"] == "vllm":
        from vllm import LLM, SamplingParams
        llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"], block_size=32,
                  max_num_seqs=max(cfg["batches"]), seed=0)
    else:
        from vlserve import LLM, SamplingParams
        llm = LLM(cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"],
                  max_num_seqs=max(cfg["batches"]), compilation_config=cfg.get("compilation_level"))
    result = {}
    for batch in cfg["batches"]:
        prompts = [{"prompt_token_ids": p} for p in cfg["prompts"][:batch]]
        sp = SamplingParams(temperature=0.0, max_tokens=cfg["output_len"], ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        best = float("inf")
        for _ in range(cfg["repeats"]):
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            best = min(best, time.perf_counter() - t)
        result[str(batch)] = sum(len(o.outputs[0].token_ids) for o in outs) / best
    result["rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print("CASE_CORES " + json.dumps(engine_cores()))
    print("CASE_RESULT " + json.dumps(result))
"""


def run_case(python: str, engine: str, model: str, cfg: dict) -> dict | str:
    """One engine ("vlserve", "vllm" or "hf") on one checkpoint in its own process (`python`): {batch: tok/s,
    "rss_gib": ...}, or the error's last line."""
    return run_script(python, _CASE, engine, model, cfg)


def run_script(python: str, script: str, engine: str, model: str, cfg: dict) -> dict | str:
    """Run `script` (it reads `sys.argv[1]`, JSON of cfg + engine + model, and prints `CASE_RESULT <json>`, after
    `CASE_CORES <json>` of `engine_cores()`, which CORES_PROBE defines) in its own process with `python` (vLLM-CPU's
    environment for engine "vllm", every core bound): the result, or the error's last line. Prints the cores the
    engine's processes could use."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(CORES_PROBE + script)
    env = vllm_cpu_env() if engine == "vllm" else dict(os.environ)
    proc = subprocess.run(
        [python, f.name, json.dumps({**cfg, "engine": engine, "model": model})],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("CASE_CORES "):
            print(f"# {engine} cores: {line[len('CASE_CORES ') :]}", flush=True)
        if line.startswith("CASE_RESULT "):
            return json.loads(line[len("CASE_RESULT ") :])
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    print(f"{engine} on {model} failed (exit {proc.returncode}):\n" + "\n".join(tail[-15:]), file=sys.stderr)
    return f"failed: {tail[-1][:160] if tail else proc.returncode}"


def add_case_args(p, num_prompts: int, input_len: int, output_len: int) -> None:
    """The flags every one-process-per-engine comparison takes: the checkpoint (or the random Qwen2 to build),
    vLLM-CPU's python, the workload, repeats, dtype and seed."""
    p.add_argument("--model", help="local checkpoint; default: a random Qwen2 of --hidden-size/--num-layers")
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--vllm-python", help="python of a venv with vLLM-CPU")
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--input-len", type=int, default=input_len)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)


def case_setup(args) -> tuple[str, dict]:
    """(the checkpoint, built when --model is not given; the case config every script reads: random prompts,
    dtype, output_len, repeats, max_model_len)."""
    from transformers import AutoConfig

    model = args.model or build_random_model(args)
    vocab = AutoConfig.from_pretrained(model).get_text_config().vocab_size
    return model, dict(
        prompts=make_prompts(args.num_prompts, args.input_len, vocab, args.seed),
        dtype=args.dtype,
        output_len=args.output_len,
        repeats=args.repeats,
        max_model_len=args.input_len + args.output_len + 8,
    )


def run_engines(script: str, model: str, cfg: dict, vllm_python: str | None) -> dict:
    """`script` for vlserve (this python) and, with `vllm_python`, for vLLM-CPU: {"vlserve": ..., "vllm": ...}."""
    results = {"vlserve": run_script(sys.executable, script, "vlserve", model, cfg)}
    if vllm_python:
        results["vllm"] = run_script(vllm_python, script, "vllm", model, cfg)
    return results
