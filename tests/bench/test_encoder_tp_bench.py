"""benchmarks/encoder_tp.py: its flags, and a smoke run (a tiny tower over one and two spawned CPU ranks)."""

from __future__ import annotations

import pytest

from benchmarks.encoder_tp import main, parse_args, step_images


def test_flags_and_the_step_images():
    args = parse_args(["--images", "3", "--sizes", "56", "112", "--dtype", "float32"])
    assert (args.depth, args.width, args.heads) == (32, 1280, 16)  # Qwen2-VL-2B's tower by default
    grids = [grid for _, grid in step_images(args)]
    assert grids == [(1, 4, 4), (1, 8, 8), (1, 4, 4)]
    with pytest.raises(SystemExit):
        parse_args(["--sizes", "50"])  # not a multiple of patch x merge


@pytest.mark.slow
def test_smoke_run_prints_every_mode(capsys):
    main(["--smoke"])
    out = capsys.readouterr().out
    for label in ("TP 1", "TP 2 weights", "TP 2 data"):
        assert f"{label} " in out and "images/s" in out
