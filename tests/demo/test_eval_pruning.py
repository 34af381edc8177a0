"""The pruning mode of the demo eval (training.eval --video-pruning-rates): a smoke run on the shipped model."""

from __future__ import annotations

import pytest

from training import eval as demo_eval
from training.eval_pruning import parse_rates


def test_pruning_mode_smoke(capsys):
    demo_eval.main(["--video-pruning-rates", "0,0.5", "--per-form", "1", "--ttft-samples", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    rows = {float(line.split()[0]): line.split() for line in lines[-2:]}
    assert set(rows) == {0.0, 0.5}
    tokens = {rate: float(row[-3]) for rate, row in rows.items()}  # video tokens per video
    assert 0 < tokens[0.5] < tokens[0.0]


def test_rates_are_checked():
    assert parse_rates("0,0.5,0.75") == [0.0, 0.5, 0.75]
    with pytest.raises(ValueError, match="--video-pruning-rates"):
        parse_rates("0,1")
