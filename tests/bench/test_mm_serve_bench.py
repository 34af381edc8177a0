"""benchmarks.mm_serve end to end against `vlserve serve` only (no vLLM): a tiny random Qwen2-VL built into the
checkpoint cache, 2 streamed chat requests through vlserve.bench.serve's client, one table row, logs and JSON."""

import json
import os
import re

import pytest

from benchmarks import mm_serve

TINY = ["--vision-depth", "1", "--vision-width", "64", "--hidden-size", "64", "--num-layers", "1"]


@pytest.mark.slow
def test_mm_serve_against_vlserve_only(tmp_path, capsys):
    ckpt, results = str(tmp_path / "ckpt"), str(tmp_path / "results")
    rc = mm_serve.main(
        [
            "--skip-vllm",
            "--client",
            "vlserve",
            "--workload",
            "img224",
            "--num-prompts",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--checkpoint-dir",
            ckpt,
            "--result-dir",
            results,
            "--start-timeout",
            "300",
            *TINY,
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert re.search(
        r"^machine: (AVX-512|AVX2-only|no AVX2).*; dtype float32; vLLM not used; client: "
        r"vlserve\.bench\.serve$",
        out,
        re.M,
    ), out
    # 224x224 is 8 x 8 merged patches: 64 image tokens, plus the text and template of the probe request
    row = re.search(r"^\| img224 \| vlserve \| (\d+) \| 2/2 \| ([\d.]+) \| ([\d.,]+) \| ([\d.,]+) \|", out, re.M)
    assert row, out
    assert int(row.group(1)) > 64 and float(row.group(2)) > 0 and float(row.group(3)) > 0
    assert "vLLM-CPU" not in out.split("| workload |")[1]
    built = os.listdir(ckpt)
    assert built == ["qwen2-vl-vit1x64-lm1x64-s0"]
    assert os.path.exists(os.path.join(results, "img224-vlserve.server.log"))
    summary = json.load(open(os.path.join(results, "summary.json")))
    assert summary["rows"][0]["result"]["completed"] == 2


def test_mm_serve_needs_vllm_python_unless_told_not_to(monkeypatch, capsys):
    monkeypatch.setattr(mm_serve, "ANCHOR_PYTHON", "/nonexistent/python")
    with pytest.raises(SystemExit) as e:
        mm_serve.parse_args(["--skip-vllm"])  # vLLM's client still needs vLLM's python
    assert e.value.code == 2 and "--skip-vllm --client vlserve" in capsys.readouterr().err
    args = mm_serve.parse_args(["--skip-vllm", "--client", "vlserve"])
    assert args.vllm_python is None and args.workload is None  # None: every workload


def test_workloads_and_max_model_len():
    assert list(mm_serve.WORKLOADS) == ["img224", "img448", "img896", "img448x4", "video"]
    w = mm_serve.WORKLOADS
    assert [w[n].mm_tokens() for n in w] == [64, 256, 1024, 1024, 2 * 64]  # the video: 4 of its 16 frames
    args = mm_serve.parse_args(["--skip-vllm", "--client", "vlserve"])
    assert mm_serve.max_model_len_for(w["img448x4"], args) >= 1024 + 64 + 32
