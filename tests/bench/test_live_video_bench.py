"""benchmarks/live_video.py smoke run: one short stream, the session's question hitting the prefix cache."""

from __future__ import annotations

from benchmarks.live_video import main


def test_live_video_smoke(tmp_path, capsys):
    (row,) = main(["--seconds", "6", "--repeats", "1", "--checkpoint-dir", str(tmp_path)])
    assert row["frames"] == 6
    assert row["computed"] < row["prompt"]  # the prefix's full blocks were cached before the question
    assert "live video" in capsys.readouterr().out
