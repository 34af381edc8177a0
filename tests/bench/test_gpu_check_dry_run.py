"""`make gpu-check DRY_RUN=1`: the one-command GPU check runs every step on CPU with tiny sizes, so the
script a GPU session relies on cannot rot; the report lists every step with its status, figures and command."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks.gpu_check import wheel_requirements
from benchmarks.gpu_check_steps import STEPS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_gpu_check_dry_run_reports_every_step(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_check",
            "--dry-run",
            "--out",
            str(out),
            "--work-dir",
            str(tmp_path / "work"),
            "--budget",
            "600",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    md = (out / "report.md").read_text()
    report = json.loads((out / "report.json").read_text())
    assert report["dry_run"] is True and (out / "log.txt").is_file()
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["setup"] + [s["name"] for s in STEPS]
    failed = {n: (s["status"], s.get("notes")) for n, s in steps.items() if s["status"] != "pass"}
    assert not failed, f"{failed}\n{md}\n{proc.stdout[-3000:]}"
    assert proc.returncode == 0
    for name, s in steps.items():
        assert f"| {name} | pass |" in md
        if name != "setup":
            assert s["command"] and s["figures"], name
    assert " passed" in steps["pytest_cuda"]["figures"]["summary"]
    assert steps["throughput_O1"]["figures"]["resolved level"] == 1
    assert steps["throughput_async"]["figures"]["throughput tok/s"] > 0
    assert steps["throughput_async"]["figures"]["device-fed input ids"] > 0  # deferred read-back was on
    host = steps["host_step"]["figures"]
    assert len(host) == 4 and all(isinstance(v, float) and v > 0 for v in host.values()), host
    assert steps["recompiles_mrope"]["figures"]["recompiles (TORCH_LOGS=recompiles lines)"] >= 1  # logs were read
    assert steps["chunked_prefill_race"]["figures"]["runs equal to eager sync"] == "1/1"


def test_gpu_check_only_and_skip_still_list_every_step(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(tmp_path), "--only", "build_model"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = {s["name"]: s["status"] for s in json.loads((tmp_path / "report.json").read_text())["steps"]}
    assert steps.pop("setup") == "pass" and steps.pop("build_model") == "pass"
    assert set(steps.values()) == {"skipped"} and len(steps) == len(STEPS) - 1


def test_wheelhouse_pins_what_the_gpu_machine_lacks():
    pins = dict(line.split("==") for line in wheel_requirements())
    assert {"pytest", "pydantic", "pyzmq", "xgrammar", "llguidance", "fastapi"} <= set(pins)
    # the machine's own torch family and transformers, and the large wheels no step needs, stay out (64 MiB carry)
    assert not {"torch", "torchvision", "triton", "transformers", "numpy", "av", "scipy"} & set(pins)
    assert not any(n.startswith("nvidia-") for n in pins)
