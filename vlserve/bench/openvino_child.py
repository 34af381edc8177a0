"""OpenVINO GenAI's side of `vlserve.bench.openvino_anchor`, run by the OpenVINO venv's python in its own process:

    <openvino python> vlserve/bench/openvino_child.py SPEC.json    # prints `OPENVINO_RESULT <json>` last

SPEC: {"model" (an exported IR directory), "precision" ("bf16" | "f32"), "max_num_seqs", "properties" (more
OpenVINO properties), "repeats", "anchor_env" (path of vlserve/bench/anchor_env.py), "cases": [{"name", "prompts"
(token ids), "max_tokens" (one a prompt), "schema" (a JSON schema or null)}]}. Every case runs once as a warm-up
(at most 4 tokens a request), then `repeats` rounds of all cases in turn; each case reports its fastest round: seconds,
output tokens, the length of each prompt tensor fed and of each output, and, for a constrained case, the first
outputs' text. `open_pipeline` and `greedy_config` are also what benchmarks/anchor_child.py runs OpenVINO with.
Standard library only at import time (this file is loaded by path from other venvs).
"""

from __future__ import annotations

import importlib.util
import json
import resource
import sys
import time

PRECISION = {"bfloat16": "bf16", "float32": "f32"}  # INFERENCE_PRECISION_HINT of compute in each dtype


def load_by_path(name: str, path: str):
    """The module in the file `path`, imported as `name` without its package."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def open_pipeline(model: str, precision: str, max_num_seqs: int, properties: dict, prefix_caching: bool = False):
    """(ContinuousBatchingPipeline on the CPU with compute precision `precision`, its INFERENCE_NUM_THREADS)."""
    import openvino as ov
    import openvino_genai

    scheduler = openvino_genai.SchedulerConfig()
    scheduler.enable_prefix_caching = prefix_caching
    scheduler.max_num_seqs = max_num_seqs
    props = {"INFERENCE_PRECISION_HINT": precision, **properties}
    pipe = openvino_genai.ContinuousBatchingPipeline(model, scheduler, "CPU", props)
    return pipe, ov.Core().get_property("CPU", "INFERENCE_NUM_THREADS")


def greedy_config(max_tokens: int, schema: dict | None = None):
    """Greedy generation of exactly `max_tokens` tokens (ignore_eos), prompts as given (no chat template), JSON
    constrained to `schema` when one is given."""
    import openvino_genai

    cfg = openvino_genai.GenerationConfig()
    cfg.max_new_tokens = cfg.min_new_tokens = max_tokens
    cfg.ignore_eos = True
    cfg.do_sample = False
    cfg.apply_chat_template = False
    if schema is not None:
        cfg.structured_output_config = openvino_genai.StructuredOutputConfig(json_schema=json.dumps(schema))
    return cfg


def run(spec: dict) -> dict:
    """Load the pipeline, warm every case up, then time `repeats` rounds of all cases; each case's fastest."""
    import numpy as np
    import openvino as ov

    anchor_env = load_by_path("anchor_env", spec["anchor_env"])
    t0 = time.perf_counter()
    pipe, threads = open_pipeline(
        spec["model"], spec["precision"], spec["max_num_seqs"], spec["properties"], prefix_caching=True
    )
    load_s = time.perf_counter() - t0
    cores = {**anchor_env.process_tree_cores(), "openvino INFERENCE_NUM_THREADS": threads}
    tokenizer = pipe.get_tokenizer()
    inputs = {c["name"]: [ov.Tensor(np.array([p], dtype=np.int64)) for p in c["prompts"]] for c in spec["cases"]}
    for c in spec["cases"]:
        pipe.generate(inputs[c["name"]][:2], [greedy_config(min(n, 4), c["schema"]) for n in c["max_tokens"][:2]])
    best: dict[str, dict] = {}
    for _ in range(spec["repeats"]):
        for c in spec["cases"]:
            configs = [greedy_config(n, c["schema"]) for n in c["max_tokens"]]
            t = time.perf_counter()
            outs = pipe.generate(inputs[c["name"]], configs)
            seconds = time.perf_counter() - t
            if c["name"] in best and best[c["name"]]["seconds"] <= seconds:
                continue
            output_tokens = [len(o.m_generation_ids[0]) for o in outs]
            best[c["name"]] = {
                "seconds": seconds,
                "tokens": sum(output_tokens),
                "prompt_tokens": [int(t.get_shape()[1]) for t in inputs[c["name"]]],
                "output_tokens": output_tokens,
                "texts": [tokenizer.decode(o.m_generation_ids[0]) for o in outs[:3]] if c["schema"] else [],
            }
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"load_s": load_s, "cores": cores, "rss_gib": rss_gib, "cases": best}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print("OPENVINO_RESULT " + json.dumps(run(json.load(f))), flush=True)
