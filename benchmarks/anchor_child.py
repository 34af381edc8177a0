"""One engine's offline run of prepared workloads, in its own process: vlserve (`vlserve.LLM`), vLLM-CPU
(`vllm.LLM`) or OpenVINO GenAI (`ContinuousBatchingPipeline`), each run by its own venv's python.

    <python> benchmarks/anchor_child.py SPEC.json      # prints `CHILD_RESULT <json>` as its last such line

SPEC: {"engine", "model" (for OpenVINO: the exported directory), "dtype" ("bfloat16" | "float32"),
"max_model_len", "max_num_seqs", "anchor_env" (path of vlserve/bench/anchor_env.py), "openvino_child" (path of
vlserve/bench/openvino_child.py, whose pipeline and generation config OpenVINO runs with), "engine_kwargs" (optional:
more `LLM` arguments, or OpenVINO properties), "workloads": [{"name",
"max_tokens", "sets": {"warmup" | "ttft" | "main": {"prompts": [str], "images": path of a uint8 [n, H, W, 3] .npy
or null}}}]}. Every prompt is final text (chat template already applied, image placeholders in place); every
engine gets the same strings and images and generates greedily exactly `max_tokens` tokens (ignore_eos). Per
workload: a warm-up on "warmup", the "ttft" set with max_tokens=1 (its wall time: every request's first token,
all submitted at once), then the "main" set, timed; with each request's prompt and output token counts and the
engine's own mean time to first token where it reports one (OpenVINO: its output count from how it finished
and the call's total, as its VLM results carry no token ids). Standard library only at import time: each engine's
modules are imported by the function that runs it.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time


def _load_by_path(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _images(path: str | None) -> list:
    """The set's images as uint8 [H, W, 3] arrays (None per prompt when the set has none)."""
    if path is None:
        return []
    import numpy as np

    return list(np.load(path))


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


class VllmStyleEngine:
    """vlserve's and vLLM's offline `LLM`: same call, same outputs."""

    def __init__(self, spec: dict):
        self.engine = spec["engine"]
        common = dict(
            dtype=spec["dtype"],
            max_model_len=spec["max_model_len"],
            max_num_seqs=spec["max_num_seqs"],
            limit_mm_per_prompt={"image": 1},
            enable_prefix_caching=False,
        )
        if self.engine == "vllm":
            from vllm import LLM, SamplingParams

            # block_size: a multiple of 32 on CPU; --runner generate: vLLM 0.32 resolved Qwen2-VL to pooling without
            kwargs = dict(block_size=32, runner="generate", seed=0, disable_log_stats=False, **common)
            self.llm = LLM(model=spec["model"], **{**kwargs, **spec.get("engine_kwargs", {})})
        else:
            from vlserve import LLM, SamplingParams

            self.llm = LLM(spec["model"], **{**common, **spec.get("engine_kwargs", {})})
        self.sampling_params = SamplingParams

    def generate(self, prompts: list[str], images: list, max_tokens: int) -> list[dict]:
        from PIL import Image

        inputs = [
            {"prompt": p, "multi_modal_data": {"image": Image.fromarray(images[i])}} if images else {"prompt": p}
            for i, p in enumerate(prompts)
        ]
        sp = self.sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate(inputs, sp, use_tqdm=False)
        return [
            {"prompt_tokens": len(o.prompt_token_ids), "output_tokens": len(o.outputs[0].token_ids), "ttft": _ttft(o)}
            for o in outs
        ]


def _ttft(out) -> float | None:
    """The engine's own time to first token of one request: vlserve's RequestMetrics, vLLM's RequestStateStats."""
    metrics = getattr(out, "metrics", None)
    if metrics is None:
        return None
    if hasattr(metrics, "time_to_first_token"):
        return metrics.time_to_first_token
    return getattr(metrics, "first_token_latency", None) or None


class OpenVinoEngine:
    """OpenVINO GenAI's ContinuousBatchingPipeline on the CPU, compute precision from the dtype; prompts go as
    they are (no chat template of its own), images as uint8 [1, H, W, 3] tensors."""

    def __init__(self, spec: dict):
        import openvino as ov

        child = _load_by_path("openvino_child", spec["openvino_child"])
        precision, properties = child.PRECISION[spec["dtype"]], spec.get("engine_kwargs", {})
        self.pipe, self.threads = child.open_pipeline(spec["model"], precision, spec["max_num_seqs"], properties)
        self.ov, self.greedy_config = ov, child.greedy_config

    def generate(self, prompts: list[str], images: list, max_tokens: int) -> list[dict]:
        configs = [self.greedy_config(max_tokens)] * len(prompts)
        tensors = [[self.ov.Tensor(img[None])] for img in images] if images else [[] for _ in prompts]
        outs = self.pipe.generate(prompts, images=tensors, generation_config=configs)
        return [_openvino_counts(o, max_tokens) for o in outs]


def _openvino_counts(result, max_tokens: int) -> dict:
    """Counts of one VLMDecodedResults: its prompt tokens and time to first token from its perf metrics; it has no
    token ids, so its output is max_tokens long when it finished by length (min_new_tokens = max_new_tokens), and
    `batch_output_tokens` is the metrics' count of the whole call, for the caller to check."""
    pm = result.perf_metrics
    by_length = all(r.name == "LENGTH" for r in result.finish_reasons)
    return {
        "prompt_tokens": pm.get_num_input_tokens(),
        "output_tokens": max_tokens if by_length else None,
        "batch_output_tokens": pm.get_num_generated_tokens(),
        "ttft": pm.get_ttft().mean / 1e3 if pm.get_ttft().mean > 0 else None,  # ms -> s
    }


def run(spec: dict) -> dict:
    """Load the engine, then per workload a warm-up, the max_tokens=1 pass and the timed pass."""
    anchor_env = _load_by_path("anchor_env", spec["anchor_env"])
    t0 = time.perf_counter()
    engine = OpenVinoEngine(spec) if spec["engine"] == "openvino" else VllmStyleEngine(spec)
    result = {"load_s": time.perf_counter() - t0, "cores": anchor_env.process_tree_cores(), "workloads": {}}
    if spec["engine"] == "openvino":
        result["cores"]["openvino INFERENCE_NUM_THREADS"] = engine.threads
    else:
        import torch

        result["cores"]["torch threads (this process)"] = torch.get_num_threads()
    for w in spec["workloads"]:
        sets = {name: (s["prompts"], _images(s["images"])) for name, s in w["sets"].items()}
        engine.generate(*sets["warmup"], max_tokens=min(4, w["max_tokens"]))
        t = time.perf_counter()
        first = engine.generate(*sets["ttft"], max_tokens=1)
        ttft_s = time.perf_counter() - t
        t = time.perf_counter()
        main = engine.generate(*sets["main"], max_tokens=w["max_tokens"])
        total_s = time.perf_counter() - t
        result["workloads"][w["name"]] = {
            "ttft_pass_s": ttft_s,
            "total_s": total_s,
            "prompt_tokens": [r["prompt_tokens"] for r in main],
            "output_tokens": [r["output_tokens"] for r in main],
            "ttft_pass_output_tokens": [r["output_tokens"] for r in first],
            "engine_mean_ttft_s": _mean([r["ttft"] for r in main]),
        }
        if "batch_output_tokens" in main[0]:
            result["workloads"][w["name"]]["batch_output_tokens"] = main[0]["batch_output_tokens"]
        print(f"# {spec['engine']} {w['name']}: {json.dumps(result['workloads'][w['name']])}", flush=True)
    return result


if __name__ == "__main__":  # vLLM spawns its engine core: this file must be importable without side effects
    with open(sys.argv[1]) as f:
        print("CHILD_RESULT " + json.dumps(run(json.load(f))), flush=True)
