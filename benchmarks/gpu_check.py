"""One-command GPU check: every CUDA figure and test of the project in one run, one report.

    make gpu-check OUT=gpu-report            # on a CUDA machine: writes gpu-report/report.{md,json}
    make gpu-check DRY_RUN=1                 # on CPU with tiny sizes (what CI runs, so the script cannot rot)
    python -m benchmarks.gpu_check --out DIR [--dry-run] [--only STEP ...] [--skip STEP ...] [--budget S]
    python -m benchmarks.gpu_check --wheel-requirements   # the pins `make gpu-wheels` downloads

Each step (`gpu_check_steps.STEPS`) runs in a process of its own, under its own time limit (and the run's overall
budget), so a crash, a hang or a CUDA error in one leaves the others running; its pass/fail, figures, notes, command
and seconds go into OUT/report.json and OUT/report.md, rewritten after every step (a run killed midway still leaves
a report), and its output into OUT/log.txt. Three files in all: they fit what a lent GPU machine sends back.

The steps' limits add up to more than one 10-minute call, and a session's 15 minutes of device time include the
machine's start (a minute or more) and the machine goes back 30 s after a call: run it as calls on the same warm
machine, prepared beforehand, split with --only (the work dir under the temp dir keeps the 1.2B checkpoint and
inductor's cache between them), e.g. `--only pytest_cuda parity_cuda` (verdicts first), then `--only build_model
throughput_O2 throughput_async hf_generate host_step`, then the rest (2026-11-26's runs: docs/benchmarks.md,
"First run on a GPU" and after).

Before the steps, on a real run, the packages the check needs beyond the machine's own torch / triton / transformers
(vlserve's dependencies and pytest; `wheel_requirements`) are installed from ./wheelhouse, which `make gpu-wheels`
fills here (Python 3.12 manylinux wheels) and which travels with the working tree: only those missing there, with
`pip install --no-index --find-links wheelhouse`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELHOUSE = REPO / "wheelhouse"
STEPS_MODULE = "benchmarks.gpu_check_steps"

# What the GPU machine brings (with their dependencies): never in the wheelhouse.
PROVIDED = ("torch", "torchvision", "torchaudio", "triton", "transformers")
# Dependencies the check never imports, left out so the wheelhouse stays inside the 64 MiB a working tree may carry
# to the GPU machine (the tracked tree alone is ~45 MB): av (video and audio decoding, ~40 MB; no step decodes
# media files), scipy (audio resampling, ~35 MB) and timm (timm vision towers, ~3 MB); the last two are on the lent
# image already.
NOT_NEEDED = ("av", "scipy", "timm")
EXTRA_ROOTS = ("pytest",)  # the test runner of the CUDA subset

RECOMPILE_LINE = re.compile(r"Recompiling function")


# -- the wheelhouse -------------------------------------------------------------------------------------------------
def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(dist: str, extras=()) -> list[str]:
    """Names `dist` requires on CPython 3.12 / Linux (its installed metadata here), with `extras`."""
    from importlib import metadata

    from packaging.requirements import Requirement

    out = []
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        env = {
            "python_version": "3.12",
            "python_full_version": "3.12.3",
            "sys_platform": "linux",
            "platform_system": "Linux",
            "platform_machine": "x86_64",
            "implementation_name": "cpython",
            "platform_python_implementation": "CPython",
            "os_name": "posix",
        }
        if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in ("", *extras)):
            out.append(_norm(req.name))
    return out


def _closure(roots) -> set[str]:
    from importlib import metadata

    seen, todo = set(), [_norm(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += _requirement_names(name)
        except metadata.PackageNotFoundError:
            pass
    return seen


def wheel_requirements() -> list[str]:
    """`name==version` (this venv's versions) of every distribution the check needs beyond the GPU machine's own
    torch / triton / transformers and what they depend on: vlserve's dependencies (pyproject.toml) and pytest, with
    their dependencies, less NOT_NEEDED and nvidia-*."""
    import tomllib
    from importlib import metadata

    from packaging.requirements import Requirement

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    roots = [_norm(Requirement(d).name) for d in deps] + list(EXTRA_ROOTS)
    # torch's family with all its dependencies; transformers and the hub with their direct ones only (deeper ones
    # differ between versions: this venv's may need what the machine's older ones do not, pydantic say)
    provided = _closure(p for p in PROVIDED if p != "transformers") | {"transformers", "huggingface-hub"}
    provided |= set(_requirement_names("transformers") + _requirement_names("huggingface-hub"))
    wanted = _closure(r for r in roots if r not in PROVIDED and r not in NOT_NEEDED)
    wanted -= provided | set(NOT_NEEDED)
    lines = []
    for name in sorted(wanted):
        if name.startswith("nvidia-"):
            continue
        try:
            lines.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            print(f"# {name}: not installed here, left out", file=sys.stderr)
    return lines


def install_wheelhouse(log) -> dict:
    """Install from ./wheelhouse what its requirements.txt names and this python lacks; returns the setup record."""
    from importlib import metadata

    record = {"wheelhouse": str(WHEELHOUSE), "installed": [], "missing_after": []}
    reqs = WHEELHOUSE / "requirements.txt"
    if not reqs.is_file():
        record["note"] = "no wheelhouse/requirements.txt (run `make gpu-wheels` where pip reaches PyPI)"
        return record
    names = [line.split("==")[0] for line in reqs.read_text().split() if line and not line.startswith("#")]

    def missing():
        out = []
        for n in names:
            try:
                metadata.version(n)
            except metadata.PackageNotFoundError:
                out.append(n)
        return out

    todo = missing()
    if todo:
        base = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(WHEELHOUSE)]
        pins = [line for line in reqs.read_text().split() if line.split("==")[0] in todo]
        cmd = base + pins
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:  # e.g. a dependency neither here nor in the wheelhouse: take the wheels alone
            log(proc.stdout + proc.stderr)
            cmd = base + ["--no-deps"] + pins
            proc = subprocess.run(cmd, capture_output=True, text=True)
            log(proc.stdout + proc.stderr)
        record["command"] = " ".join(cmd)
        record["installed"] = todo
        record["missing_after"] = missing()
    return record


# -- the report -----------------------------------------------------------------------------------------------------
class Report:
    """report.json + report.md in `out`, rewritten after every step."""

    def __init__(self, out: Path, meta: dict):
        self.out, self.meta, self.steps = out, meta, []
        out.mkdir(parents=True, exist_ok=True)
        self.log_path = out / "log.txt"
        self.log_path.write_text("")

    def log(self, text: str) -> None:
        with open(self.log_path, "a") as f:
            f.write(text if text.endswith("\n") or not text else text + "\n")

    def add(self, record: dict) -> None:
        self.steps.append(record)
        self.write()

    def summary(self) -> dict:
        counts = {}
        for s in self.steps:
            counts[s["status"]] = counts.get(s["status"], 0) + 1
        return counts

    def write(self) -> None:
        data = {**self.meta, "summary": self.summary(), "steps": self.steps}
        tmp = self.out / "report.json.tmp"
        tmp.write_text(json.dumps(data, indent=2, default=str))
        os.replace(tmp, self.out / "report.json")
        (self.out / "report.md").write_text(self.markdown())

    def markdown(self) -> str:
        m = self.meta
        lines = [
            f"# vlserve GPU check{' (dry run, CPU, tiny sizes)' if m.get('dry_run') else ''}",
            "",
            f"- device: {m.get('device')}",
            f"- torch {m.get('torch')}, triton {m.get('triton')}, "
            f"transformers {m.get('transformers')}, Python {m.get('python')}",
            f"- commit: {m.get('commit')}; started {m.get('started')}; budget {m.get('budget_s')} s",
            f"- summary: {', '.join(f'{v} {k}' for k, v in self.summary().items()) or 'no steps yet'}",
            "",
            "| step | status | seconds | headline |",
            "|---|---|---|---|",
        ]
        for s in self.steps:
            lines.append(
                f"| {s['name']} | {s['status']} | {s.get('seconds', 0):.1f} | "
                f"{s.get('headline', '').replace('|', '/')} |"
            )
        for s in self.steps:
            lines += [
                "",
                f"## {s['name']}: {s['status']}",
                "",
                s.get("what", ""),
                "",
                f"command: `{s.get('command', '')}`",
            ]
            for k, v in (s.get("figures") or {}).items():
                lines.append(f"- {k}: {v}")
            for note in s.get("notes") or []:
                lines.append(f"- note: {note}")
            if s["status"] not in ("pass", "skipped") and s.get("log_tail"):
                lines += ["", "```", *s["log_tail"][-15:], "```"]
        return "\n".join(lines) + "\n"


def _environment(dry_run: bool, budget: float) -> dict:
    import platform

    meta = {
        "dry_run": dry_run,
        "python": platform.python_version(),
        "budget_s": budget,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        meta["commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
            ).stdout.strip()
            or None
        )
    except OSError:
        meta["commit"] = None
    probe = (
        "import json, torch\ntry:\n import triton; tv = triton.__version__\nexcept Exception: tv = None\n"
        "try:\n import transformers; hv = transformers.__version__\nexcept Exception: hv = None\n"
        "cuda = torch.cuda.is_available()\n"
        "print(json.dumps({'torch': torch.__version__, 'triton': tv, 'transformers': hv, 'cuda': cuda,"
        " 'device': torch.cuda.get_device_name() if cuda else 'CPU'}))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    try:
        meta.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        meta["probe_error"] = proc.stderr[-500:]
    return meta


# -- running the steps ----------------------------------------------------------------------------------------------
def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stamp_lines(stream, t0: float, lines: list[str]) -> None:
    """Read a step's output line by line, each prefixed with the seconds since the step started (a step killed at
    its limit then shows where its time went: compiling, capturing graphs, or running)."""
    for line in stream:
        lines.append(f"[{time.perf_counter() - t0:6.1f} s] {line.rstrip()}")


def run_step(spec: dict, cfg: dict, timeout: float, report: Report, child_env: dict) -> dict:
    """One step in its own process (`python -m benchmarks.gpu_check_steps NAME`); its record for the report."""
    name = spec["name"]
    result_path = Path(cfg["work_dir"]) / f"result-{name}.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", STEPS_MODULE, name, "--config", json.dumps(cfg), "--result", str(result_path)]
    env = {**child_env, **spec.get("env", {})}
    env_shown = " ".join(f"{k}={v}" for k, v in spec.get("env", {}).items())  # the step's own env, as it runs
    shown = " ".join([env_shown, "python -m", STEPS_MODULE, name, "--dry-run" if cfg["dry_run"] else ""]).strip()
    record = {"name": name, "what": spec["what"], "command": shown, "timeout_s": round(timeout)}
    report.log(f"\n===== {name} (limit {timeout:.0f} s): {shown}")
    t0 = time.perf_counter()
    lines: list[str] = []
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO, text=True, start_new_session=True
    )
    reader = threading.Thread(target=_stamp_lines, args=(proc.stdout, t0, lines), daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.wait()
        rc = None
    _kill_group(proc)  # whatever it left behind (engine-core or worker processes)
    reader.join(timeout=5)
    text = "\n".join(lines)
    record["seconds"] = round(time.perf_counter() - t0, 1)
    report.log(text)
    result = {}
    if result_path.is_file():
        result = json.loads(result_path.read_text())
    record["figures"] = result.get("figures", {})
    record["notes"] = result.get("notes", [])
    record["command"] = f"{env_shown} {result['command']}".strip() if result.get("command") else shown
    if spec.get("count_recompiles"):
        record["figures"]["recompiles (TORCH_LOGS=recompiles lines)"] = len(RECOMPILE_LINE.findall(text))
    if rc is None:
        record["status"] = "timeout"
        record["notes"].append(f"killed after {timeout:.0f} s")
    elif rc != 0 or not result:
        record["status"] = "fail"
        record["notes"].append(f"exit code {rc}")
    else:
        record["status"] = result.get("status", "pass")
    record["headline"] = result.get("headline", "")
    limit = spec.get("max_recompiles")
    if spec.get("count_recompiles") and limit is not None and record["status"] == "pass":
        n = record["figures"]["recompiles (TORCH_LOGS=recompiles lines)"]
        record["headline"] = f"{n} recompiles; {record['headline']}"
        if n > limit:
            record["status"] = "fail"
            record["notes"].append(f"{n} recompiles > {limit} (dynamo's recompile limit is 8 per code object)")
    record["log_tail"] = text.strip().splitlines()[-40:]
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu-report", help="directory for report.md, report.json and log.txt")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: checks the script, not the GPU")
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for all steps together (default 590 on CUDA, 240 in a dry run)",
    )
    p.add_argument("--only", nargs="+", default=None, metavar="STEP", help="run only these steps")
    p.add_argument("--skip", nargs="+", default=(), metavar="STEP", help="leave these steps out")
    p.add_argument(
        "--work-dir",
        default=None,
        help="checkpoints and compile caches (default: a fixed dir under the temp dir on CUDA, so a "
        "rerun reuses the 1.2B checkpoint and inductor's cache; a fresh one in a dry run)",
    )
    p.add_argument(
        "--wheel-requirements",
        action="store_true",
        help="print the name==version pins of the wheelhouse (`make gpu-wheels`) and exit",
    )
    p.add_argument("--list", action="store_true", help="print the steps and exit")
    args = p.parse_args(argv)
    if args.wheel_requirements:
        print("\n".join(wheel_requirements()))
        return 0
    from benchmarks.gpu_check_steps import STEPS

    if args.list:
        for s in STEPS:
            print(f"{s['name']:<22} {s['budget'][0]:>4.0f} s  {s['what']}")
        return 0
    names = [s["name"] for s in STEPS]
    for n in [*(args.only or []), *args.skip]:
        if n not in names:
            p.error(f"unknown step {n!r}; the steps are {', '.join(names)}")
    t_start = time.perf_counter()
    budget = args.budget or (240.0 if args.dry_run else 590.0)
    out = Path(args.out).resolve()
    work = Path(
        args.work_dir
        or (
            tempfile.mkdtemp(prefix="vlserve-gpu-check-")
            if args.dry_run
            else os.path.join(tempfile.gettempdir(), "vlserve-gpu-check")
        )
    )
    work.mkdir(parents=True, exist_ok=True)
    report = Report(out, {})
    setup = {
        "name": "setup",
        "what": "Python, torch and the GPU; packages from ./wheelhouse",
        "status": "pass",
        "command": "",
        "figures": {},
        "notes": [],
    }
    t0 = time.perf_counter()
    if args.dry_run:
        setup["notes"].append("dry run: no wheelhouse install")
    elif WHEELHOUSE.is_dir():
        rec = install_wheelhouse(report.log)
        setup["command"] = rec.pop("command", "")
        setup["figures"] = {"installed from wheelhouse": ", ".join(rec["installed"]) or "nothing (all present)"}
        if rec.get("note"):
            setup["notes"].append(rec["note"])
        if rec["missing_after"]:
            setup["status"] = "fail"
            setup["notes"].append(f"still missing: {', '.join(rec['missing_after'])}")
    else:
        setup["notes"].append("no ./wheelhouse (run `make gpu-wheels` where pip reaches PyPI, and carry it)")
    report.meta = _environment(args.dry_run, budget)
    if not args.dry_run and not report.meta.get("cuda"):
        setup["status"] = "fail"
        setup["notes"].append("no CUDA device: the figures below are CPU figures (use --dry-run on CPU)")
    setup["figures"].update({k: report.meta.get(k) for k in ("device", "torch", "triton", "transformers")})
    setup["headline"] = str(report.meta.get("device"))
    setup["seconds"] = round(time.perf_counter() - t0, 1)
    report.add(setup)
    cfg = {"dry_run": args.dry_run, "work_dir": str(work), "repo": str(REPO)}
    child_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "PYTHONUNBUFFERED": "1",
    }
    child_env.pop("TORCH_LOGS", None)
    child_env.pop("VLSERVE_DEFAULT_COMPILE_LEVEL", None)  # "the device default" in the steps means -O2 on CUDA
    if not args.dry_run:
        child_env.pop("TRITON_INTERPRET", None)
    for spec in STEPS:
        name = spec["name"]
        if (args.only and name not in args.only) or name in args.skip:
            report.add(
                {
                    "name": name,
                    "what": spec["what"],
                    "status": "skipped",
                    "seconds": 0.0,
                    "notes": ["left out (--only / --skip)"],
                    "headline": "left out",
                }
            )
            continue
        left = budget - (time.perf_counter() - t_start)
        step_budget = spec["budget"][1 if args.dry_run else 0]
        if left < min(step_budget, 15):
            report.add(
                {
                    "name": name,
                    "what": spec["what"],
                    "status": "skipped",
                    "seconds": 0.0,
                    "notes": [f"out of time: {left:.0f} s of the {budget:.0f} s budget left"],
                    "headline": "out of time",
                }
            )
            continue
        print(f"[gpu-check] {name} (limit {min(step_budget, left):.0f} s) ...", flush=True)
        record = run_step(spec, cfg, min(step_budget, left), report, child_env)
        print(
            f"[gpu-check] {name}: {record['status']} in {record['seconds']} s  {record.get('headline', '')}", flush=True
        )
        report.add(record)
    report.meta["total_seconds"] = round(time.perf_counter() - t_start, 1)
    report.write()
    if args.dry_run and not args.work_dir:  # the tiny checkpoints of a dry run are not worth keeping
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    print(f"[gpu-check] {report.summary()} in {report.meta['total_seconds']} s; report: {out}/report.md")
    return 0 if all(s["status"] in ("pass", "skipped") for s in report.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
