"""benchmarks.host_step: runs small, prints ms/step and a breakdown, and leaves the engine unwrapped."""

import re

from benchmarks import host_step


def test_host_step_bench_prints_ms_per_step_and_breakdown(capsys, monkeypatch):
    captured = {}
    real = host_step.component_breakdown

    def spy(llm, prompts, params):
        out = real(llm, prompts, params)
        captured["wrapped_left"] = [n for n in ("schedule", "update_from_output") if n in vars(llm.engine.scheduler)]
        captured["forward_kept"] = type(llm.engine.runner.forward).__name__ == "ModelForward"
        return out

    monkeypatch.setattr(host_step, "component_breakdown", spy)
    host_step.main(["--num-prompts", "8", "--input-len", "4", "--output-len-range", "3", "5", "--repeats", "1"])
    text = capsys.readouterr().out
    assert re.search(r"run 0: \d+ steps, .* ms/step wall, .* ms/step CPU", text)
    for label in ("scheduler.schedule", "kv.allocate_slots", "runner.forward (model)", "process_outputs"):
        assert re.search(re.escape(label) + r"\s+\d+\.\d{3}", text), label
    assert captured == {"wrapped_left": [], "forward_kept": True}


def test_host_step_null_model_table_rows_and_outputs(capsys):
    host_step.main(
        ["--null-model", "--batches", "1,4", "--input-len", "4", "--output-len-range", "3", "6", "--repeats", "1"]
    )
    text = capsys.readouterr().out
    rows = re.findall(
        r"^(sync|async)\s+(\d+)\s+(\d+)\s+(\d+\.\d{3})\s+(\d+\.\d{3})\s+(\d+\.\d{3})\s+(-?\d+\.\d{3})\s+(\S+)$",
        text,
        re.M,
    )
    assert [(m, int(b)) for m, b, *_ in rows] == [("sync", 1), ("sync", 4), ("async", 1), ("async", 4)]
    assert all(int(steps) >= 3 and float(cpu) > 0 for _, _, steps, _, cpu, *_ in rows)
    # the null model's own share is measured (positive) and the engine column is wall less it
    for _, _, _, wall, _, null_ms, engine, _ in rows:
        assert float(null_ms) > 0
        assert abs(float(wall) - float(null_ms) - float(engine)) < 2e-3
    # the engine's outputs are the null model's (each token the previous one + 1), not the random checkpoint's
    assert [ok for *_, ok in rows] == ["ok"] * 4


def test_null_model_expected_tokens_and_logits():
    import torch

    from benchmarks.null_model import NullForward, NullLogits, expected_tokens

    assert expected_tokens([5, 687], 3, 689) == [688, 0, 1]
    fwd, logits = NullForward(8, 4, torch.device("cpu")), NullLogits(10, torch.device("cpu"))
    hidden = fwd(torch.tensor([3, 9, 0]), None, None, None)
    assert hidden.shape == (3, 4)
    assert logits(hidden).argmax(-1).tolist() == [4, 0, 1]
