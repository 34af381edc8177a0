"""benchmarks.step_overhead: the before/after per-step bench runs both code versions and prints their table."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = [sys.executable, "-m", "benchmarks.step_overhead"]


@pytest.mark.slow
def test_step_overhead_runs_baseline_and_current():
    """Against HEAD itself (the clone CI runs in has it), one round of the demo workload: a row per version per
    round, and the summary row with both medians and their ratio."""
    proc = subprocess.run(
        [*BENCH, "--baseline-rev", "HEAD", "--rounds", "1", "--workloads", "demo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^round 1 demo (baseline|current) +([\d.]+) ms", proc.stdout, re.M)
    assert [name for name, _ in rows] == ["baseline", "current"]
    summary = re.search(r"^demo +([\d.]+) +([\d.]+) +([\d.]+)x$", proc.stdout, re.M)
    assert summary, proc.stdout
    base, cur, ratio = map(float, summary.groups())
    assert base == pytest.approx(float(rows[0][1]), abs=1e-3) and cur == pytest.approx(float(rows[1][1]), abs=1e-3)
    assert ratio == pytest.approx(base / cur, abs=0.01)


def test_step_overhead_rejects_unknown_workloads():
    proc = subprocess.run(
        [*BENCH, "--workloads", "demo,nonsense", "--rounds", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0 and "unknown workloads ['nonsense']" in proc.stderr


@pytest.mark.slow
def test_step_overhead_async_versus_sync():
    """`--async-scheduling --versus-sync`: both versions async, this checkout also synchronous, each ratio printed."""
    proc = subprocess.run(
        [
            *BENCH,
            "--baseline-rev",
            "HEAD",
            "--rounds",
            "1",
            "--workloads",
            "demo",
            "--async-scheduling",
            "--versus-sync",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = dict(re.findall(r"^round 1 demo (baseline|current|sync) +([\d.]+) ms", proc.stdout, re.M))
    assert sorted(rows) == ["baseline", "current", "sync"]
    assert "async scheduling" in proc.stdout
    summary = re.search(r"^demo +([\d.]+) +([\d.]+) +([\d.]+)x +([\d.]+) +([\d.]+)x$", proc.stdout, re.M)
    assert summary, proc.stdout
    base, cur, ratio, sync, sync_ratio = map(float, summary.groups())
    assert (cur, sync) == (
        pytest.approx(float(rows["current"]), abs=1e-3),
        pytest.approx(float(rows["sync"]), abs=1e-3),
    )
    assert sync_ratio == pytest.approx(sync / cur, abs=0.01)
