"""benchmarks/live_video_engine_process.py smoke run: a short stream through MPAsyncLLM, with and without the
session media store; the question's request stays small only with it."""

from __future__ import annotations

import pytest

from benchmarks.live_video_engine_process import main


@pytest.mark.slow
def test_live_video_engine_process_smoke(tmp_path, capsys):
    common = ["--seconds", "4", "8", "--repeats", "1", "--checkpoint-dir", str(tmp_path)]
    once = main(common)
    whole = main([*common, "--resend-media"])
    assert [r["frames"] for r in once] == [4, 8] == [r["frames"] for r in whole]
    assert once[1]["ask_kib"] - once[0]["ask_kib"] < (whole[1]["ask_kib"] - whole[0]["ask_kib"]) / 10
    assert "session media sent once" in capsys.readouterr().out
