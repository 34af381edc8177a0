"""The CUDA report of the throughput bench (GPU busy and the bandwidth roofline), run here with the profiler and the
device name stood in for: a GPU session should find it working, not spend its device time on a typo."""

import re

import torch

from vlserve import LLM, SamplingParams
from vlserve.bench import gpu_report
from vlserve.demo.checkpoints import build_text_checkpoint


def test_gpu_report_prints_busy_fraction_and_roofline(tmp_path, monkeypatch, capsys):
    build_text_checkpoint(
        str(tmp_path),
        arch="qwen2",
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        seed=0,
    )
    llm = LLM(str(tmp_path), dtype="float32", max_num_seqs=4, max_model_len=64, num_kv_blocks=32)
    prompts = [[5, 6, 7, 8], [9, 10]]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True) for _ in prompts]
    runs = []

    def busy(run):  # the profiled run still runs: (kernel seconds, wall seconds)
        runs.append(run())
        return 0.25, 1.0

    monkeypatch.setattr(gpu_report, "gpu_busy_fraction", busy)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H100 80GB HBM3")
    monkeypatch.delenv("VLSERVE_PEAK_BW_GBS", raising=False)
    gpu_report.print_gpu_report(llm, prompts, params, seconds=0.5, steps=10)
    out = capsys.readouterr().out
    assert len(runs) == 1 and [len(o.outputs[0].token_ids) for o in runs[0]] == [6, 6]
    assert "GPU busy: 25.0% (kernel 0.250 s / wall 1.000 s" in out
    weights = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    m = re.search(
        r"roofline: ([\d.]+) GB per decode step \(weights ([\d.]+) GB \+ KV\) at 3\.35 TB/s = ([\d.]+) "
        r"ms/step; measured 50\.000 ms/step",
        out,
    )
    assert m and abs(float(m.group(2)) - weights / 1e9) < 0.01 and float(m.group(1)) >= float(m.group(2))
    # an unknown device asks for the bandwidth instead of guessing
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "Some GPU")
    gpu_report.print_gpu_report(llm, prompts, params, seconds=0.5, steps=10)
    assert "unknown peak bandwidth for Some GPU (set VLSERVE_PEAK_BW_GBS)" in capsys.readouterr().out
    monkeypatch.setenv("VLSERVE_PEAK_BW_GBS", "1000")
    gpu_report.print_gpu_report(llm, prompts, params, seconds=0.5, steps=10)
    assert "at 1.00 TB/s" in capsys.readouterr().out
    llm.shutdown()
