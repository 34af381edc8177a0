"""benchmarks.quantized: each case in a fresh process, the table and ratios printed, vlserve's -O level passed
through to its engine."""

import pathlib
import re

import pytest

from benchmarks import quantized

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "quant" / "ct_w4a16"


@pytest.mark.slow
def test_quantized_bench_runs_vlserve_cases_at_the_given_level(capsys):
    quantized.main(
        [
            "--base",
            str(FIXTURE),
            "--quantized",
            f"w4a16={FIXTURE}",
            "--batches",
            "1,2",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--repeats",
            "1",
            "-O0",
        ]
    )
    out = capsys.readouterr().out
    assert "greedy, vlserve -O0" in out, out
    rows = re.findall(
        r"^\| (base|w4a16) \| vlserve \| [\d.]+ \(1\.00x\) \| [\d.]+ \| ([\d.]+) \| [\d.]+x \| ([\d.]+) \|", out, re.M
    )
    assert [r[0] for r in rows] == ["base", "w4a16"], out
    assert all(float(b1) > 0 and float(b2) > 0 for _, b1, b2 in rows), out


def test_quantized_bench_rejects_an_unknown_level():
    with pytest.raises(SystemExit):
        quantized.main(["--base", str(FIXTURE), "-O7"])
