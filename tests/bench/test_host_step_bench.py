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
