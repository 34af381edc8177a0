"""OpenVINO GenAI as a CPU anchor beside vLLM-CPU: the checkpoint's OpenVINO IR export (cached per checkpoint and
weight format), the `--openvino` / `--openvino-python` options the benchmarks share, and token-id cases run by
`vlserve/bench/openvino_child.py` in the OpenVINO venv's own process.

A case is a set of prompts given as token ids (exactly the ids the other engines get) with each prompt's output
length, generated greedily with `ignore_eos` and `min_new_tokens` = `max_new_tokens`, optionally constrained to a
JSON schema (OpenVINO GenAI's StructuredOutputConfig). The child runs every case once as a warm-up, then
`repeats` rounds of all cases in turn, and reports each case's fastest round with its prompt and output token
counts, which `check_counts` compares with what was asked.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

from vlserve.bench.anchor_env import ANCHOR_ENV_PATH, anchor_python, openvino_env, shared_tools_dir
from vlserve.bench.openvino_child import PRECISION as OPENVINO_PRECISION

OPENVINO_LABEL = "OpenVINO GenAI"
OPENVINO_CHILD_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "openvino_child.py")
DEFAULT_EXPORT_DIR = os.path.expanduser("~/.cache/vlserve-bench/openvino")
# OpenVINO's export formats: fp16 weights for bf16 compute (the same two bytes a weight as bf16), fp32 for float32
OPENVINO_WEIGHT_FORMAT = {"bfloat16": "fp16", "float32": "fp32"}
# transformers 5's generic tokenizer class, which the exporter's transformers 4.x spells PreTrainedTokenizerFast
_TOKENIZER_CLASS_4X = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def checkpoint_stamp(path: str) -> str:
    """A key that changes when the checkpoint does: its absolute path and its files' sizes and modification times."""
    path = os.path.abspath(path)
    entries = sorted(
        (name, os.path.getsize(os.path.join(path, name)), os.path.getmtime(os.path.join(path, name)))
        for name in os.listdir(path)
        if os.path.isfile(os.path.join(path, name))
    )
    return hashlib.sha1(json.dumps([path, entries]).encode()).hexdigest()[:16]


def exporter_view(model: str, into: str) -> str:
    """`model` as the exporter's transformers 4.x reads it: links to its files in `into`, with a tokenizer_config
    whose transformers 5-only tokenizer class is renamed to its 4.x equivalent; returns `into`."""
    for name in os.listdir(model):
        if name != "tokenizer_config.json":
            os.symlink(os.path.abspath(os.path.join(model, name)), os.path.join(into, name))
    tc_path = os.path.join(model, "tokenizer_config.json")
    if os.path.exists(tc_path):
        with open(tc_path) as f:
            tc = json.load(f)
        tc["tokenizer_class"] = _TOKENIZER_CLASS_4X.get(tc.get("tokenizer_class"), tc.get("tokenizer_class"))
        with open(os.path.join(into, "tokenizer_config.json"), "w") as f:
            json.dump(tc, f, indent=1)
    return into


def openvino_export(
    model: str, dtype: str, cache_dir: str, python: str | None = None, weight_format: str | None = None
) -> str:
    """The OpenVINO IR of `model` with `weight_format` weights (default: the format of compute in `dtype`; "int8"
    compresses the weights to int8 per channel), exported once with ../shared/tools/openvino-export.py into
    `cache_dir`; later calls on the unchanged checkpoint reuse it. Returns its directory."""
    fmt = weight_format or OPENVINO_WEIGHT_FORMAT[dtype]
    out = os.path.join(cache_dir, f"{os.path.basename(os.path.abspath(model))}-{checkpoint_stamp(model)}-{fmt}")
    done = os.path.join(out, ".complete")
    if os.path.exists(done):
        return out
    python = python or anchor_python("openvino")
    exporter = os.path.join(shared_tools_dir(), "openvino-export.py")
    with tempfile.TemporaryDirectory() as view:
        cmd = [python, exporter, exporter_view(model, view), out, "--weight-format", fmt]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=openvino_env())
    if proc.returncode != 0:
        raise RuntimeError(f"OpenVINO export of {model} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    open(done, "w").close()
    return out


def ir_weight_bytes(ir_dir: str) -> int:
    """Bytes of an exported model's weights (its openvino_*model*.bin files, the tokenizers' left out)."""
    return sum(
        os.path.getsize(os.path.join(ir_dir, f))
        for f in os.listdir(ir_dir)
        if f.endswith(".bin") and "model" in f and "tokenizer" not in f
    )


def add_openvino_args(parser) -> None:
    """--openvino, --openvino-python and --openvino-export-dir: run OpenVINO GenAI on the same checkpoint too."""
    parser.add_argument(
        "--openvino",
        action="store_true",
        help=f"also run {OPENVINO_LABEL} on the same checkpoint (its venv: ../shared/tools/setup-openvino-anchor.sh, "
        "installed when missing)",
    )
    parser.add_argument("--openvino-python", default=None, help="python of the OpenVINO venv (implies --openvino)")
    parser.add_argument(
        "--openvino-export-dir", default=DEFAULT_EXPORT_DIR, help="where the checkpoint's OpenVINO IR is cached"
    )


def openvino_python(args) -> str | None:
    """The OpenVINO venv's python when the run asks for OpenVINO GenAI (`--openvino` or `--openvino-python`), else
    None."""
    if args.openvino_python:
        return args.openvino_python
    return anchor_python("openvino") if args.openvino else None


@dataclass(frozen=True)
class OpenVinoCase:
    """Prompts as token ids, each prompt's output tokens, and a JSON schema to constrain them to (or None)."""

    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    schema: dict | None = None

    def __post_init__(self):
        if len(self.prompts) != len(self.max_tokens) or not self.prompts:
            raise ValueError(f"case {self.name!r}: {len(self.prompts)} prompts but {len(self.max_tokens)} lengths")


@dataclass(frozen=True)
class OpenVinoCaseResult:
    """A case's fastest round: seconds, output tokens, the token counts each request had, sample texts."""

    seconds: float
    tokens: int
    prompt_tokens: list[int]
    output_tokens: list[int]
    texts: list[str]


def check_counts(case: OpenVinoCase, result: OpenVinoCaseResult) -> None:
    """Raise ValueError unless OpenVINO saw exactly the case's prompts' lengths and generated its output lengths."""
    want_in = [len(p) for p in case.prompts]
    if result.prompt_tokens != want_in:
        raise ValueError(f"{case.name}: OpenVINO read prompts of {result.prompt_tokens} tokens, expected {want_in}")
    if result.output_tokens != case.max_tokens:
        raise ValueError(f"{case.name}: OpenVINO generated {result.output_tokens} tokens, expected {case.max_tokens}")


def run_openvino(
    python: str,
    ir_dir: str,
    dtype: str,
    cases: list[OpenVinoCase],
    repeats: int,
    properties: dict | None = None,
    timeout: float = 3600.0,
) -> dict:
    """Run `cases` on the exported model `ir_dir` in the OpenVINO venv's process (`python`), compute precision from
    `dtype`: {"load_s", "cores", "rss_gib", "cases": {name: OpenVinoCaseResult}}, the counts checked. Raises
    RuntimeError for a vision-language model's IR (no token-id input there) or with the child's last lines when it
    fails."""
    config_path = os.path.join(ir_dir, "config.json")
    if os.path.exists(config_path):
        with open(config_path) as f:
            if "vision_config" in json.load(f):
                raise RuntimeError(
                    f"{ir_dir} is a vision-language model's IR: OpenVINO's ContinuousBatchingPipeline takes its "
                    "prompts as text only, so these token-id prompts cannot be given to it unchanged"
                )
    spec = {
        "model": ir_dir,
        "precision": OPENVINO_PRECISION[dtype],
        "max_num_seqs": max(len(c.prompts) for c in cases),
        "properties": properties or {},
        "repeats": repeats,
        "anchor_env": ANCHOR_ENV_PATH,
        "cases": [asdict(c) for c in cases],
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        proc = subprocess.run(
            [python, OPENVINO_CHILD_PATH, f.name], capture_output=True, text=True, env=openvino_env(), timeout=timeout
        )
    finally:
        os.unlink(f.name)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("OPENVINO_RESULT ")), None)
    if line is None:
        tail = "\n".join([ln for ln in proc.stderr.splitlines() if ln.strip()][-15:])
        raise RuntimeError(f"{OPENVINO_LABEL} failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(line[len("OPENVINO_RESULT ") :])
    result["cases"] = {name: OpenVinoCaseResult(**r) for name, r in result["cases"].items()}
    for case in cases:
        check_counts(case, result["cases"][case.name])
    return result


def describe_run(result: dict, ir_dir: str, dtype: str) -> str:
    """One line naming the OpenVINO run: the IR, its precision, load time and the cores its process could use."""
    return (
        f"{OPENVINO_LABEL}: {os.path.basename(ir_dir)}, INFERENCE_PRECISION_HINT {OPENVINO_PRECISION[dtype]}, "
        f"loaded in {result['load_s']:.1f} s; cores {result['cores']}"
    )


def bench_openvino(
    python: str,
    model: str,
    dtype: str,
    cases: list[OpenVinoCase],
    repeats: int,
    export_dir: str = DEFAULT_EXPORT_DIR,
    weight_format: str | None = None,
    threads: int | None = None,
) -> dict | None:
    """Export `model` (cached) with `weight_format` weights and run `cases` on it (see `run_openvino`) on `threads`
    threads (default: OpenVINO's, every core), printing the run's IR, precision and cores: the result with "ir"
    (the IR directory) added, or None (the reason printed)."""
    properties = {"INFERENCE_NUM_THREADS": threads} if threads else None
    try:
        ir_dir = openvino_export(model, dtype, export_dir, python, weight_format)
        result = run_openvino(python, ir_dir, dtype, cases, repeats, properties)
    except (RuntimeError, ValueError, subprocess.TimeoutExpired) as err:
        print(f"{OPENVINO_LABEL} did not run: {err}", file=sys.stderr, flush=True)
        return None
    print(describe_run(result, ir_dir, dtype), flush=True)
    return {**result, "ir": ir_dir}
