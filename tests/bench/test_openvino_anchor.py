"""The OpenVINO GenAI anchor's pieces that need no OpenVINO: its options, the exporter's view of a checkpoint, the
export cache, the child's result checked against the cases it was given (a stand-in child run by this python), and
the rows the benchmarks print beside vLLM-CPU's; (slow) `vlserve bench throughput --openvino` on a tiny model when
the OpenVINO venv is installed."""

import argparse
import json
import os
import re
import sys

import pytest

from benchmarks import mm_openvino, mm_serve, quantized, structured
from vlserve.bench import openvino_anchor, throughput
from vlserve.bench.anchor_env import OPENVINO_PYTHON, shared_tools_dir
from vlserve.bench.openvino_anchor import OpenVinoCase, OpenVinoCaseResult, check_counts


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    openvino_anchor.add_openvino_args(p)
    return p


def test_openvino_is_off_unless_asked(monkeypatch):
    asked = []
    monkeypatch.setattr(openvino_anchor, "anchor_python", lambda kind: asked.append(kind) or f"/venv/{kind}/python")
    assert openvino_anchor.openvino_python(parser().parse_args([])) is None
    assert asked == []  # no venv is looked up (or installed) when the option is absent
    assert openvino_anchor.openvino_python(parser().parse_args(["--openvino-python", "/x/python"])) == "/x/python"
    assert openvino_anchor.openvino_python(parser().parse_args(["--openvino"])) == "/venv/openvino/python"
    assert asked == ["openvino"]


@pytest.mark.parametrize("bench", [throughput, quantized, structured])
def test_each_offline_bench_takes_the_openvino_options(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--openvino " in out and "--openvino-python" in out and "--openvino-export-dir" in out


def test_mm_serve_takes_the_openvino_options(monkeypatch):
    monkeypatch.setattr(mm_serve, "ANCHOR_PYTHON", "/nonexistent/python")
    args = mm_serve.parse_args(["--skip-vllm", "--client", "vlserve", "--openvino-python", "/ov/python"])
    assert args.openvino_python == "/ov/python" and not args.openvino
    args = mm_serve.parse_args(["--skip-vllm", "--client", "vlserve"])
    assert args.openvino_python is None and not args.openvino


def test_a_case_needs_one_length_per_prompt():
    with pytest.raises(ValueError, match="2 prompts but 1 lengths"):
        OpenVinoCase("b2", [[1, 2], [3]], [4])
    with pytest.raises(ValueError):
        OpenVinoCase("empty", [], [])


def test_check_counts_compares_what_openvino_saw_with_the_case():
    case = OpenVinoCase("b2", [[5, 6, 7], [8, 9]], [4, 2])
    check_counts(case, OpenVinoCaseResult(0.1, 6, [3, 2], [4, 2], []))
    with pytest.raises(ValueError, match="read prompts of"):
        check_counts(case, OpenVinoCaseResult(0.1, 6, [3, 3], [4, 2], []))
    with pytest.raises(ValueError, match="generated"):
        check_counts(case, OpenVinoCaseResult(0.1, 6, [3, 2], [4, 1], []))


def test_exporter_view_renames_transformers_5_tokenizer_class(tmp_path):
    src, view = tmp_path / "src", tmp_path / "view"
    src.mkdir()
    view.mkdir()
    (src / "config.json").write_text("{}")
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend", "x": 1}))
    openvino_anchor.exporter_view(str(src), str(view))
    assert os.path.realpath(view / "config.json") == str(src / "config.json")
    assert json.loads((view / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "x": 1,
    }
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer"}))
    view2 = tmp_path / "view2"
    view2.mkdir()
    openvino_anchor.exporter_view(str(src), str(view2))
    assert json.loads((view2 / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"


def test_export_cache_is_per_checkpoint_and_weight_format(tmp_path, monkeypatch):
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cache = tmp_path / "cache"
    stamp = openvino_anchor.checkpoint_stamp(str(model))
    for fmt in ("int8", "fp16"):
        (cache / f"ckpt-{stamp}-{fmt}").mkdir(parents=True)
        (cache / f"ckpt-{stamp}-{fmt}" / ".complete").touch()

    def no_export(*a, **k):
        raise AssertionError("a cached export ran again")

    monkeypatch.setattr(openvino_anchor.subprocess, "run", no_export)
    out = openvino_anchor.openvino_export(str(model), "bfloat16", str(cache), "/ov/python", weight_format="int8")
    assert out == str(cache / f"ckpt-{stamp}-int8")
    assert openvino_anchor.openvino_export(str(model), "bfloat16", str(cache), "/ov/python").endswith("-fp16")
    (model / "config.json").write_text('{"changed": true}')
    assert openvino_anchor.checkpoint_stamp(str(model)) != stamp


def test_ir_weight_bytes_counts_the_model_not_the_tokenizers(tmp_path):
    (tmp_path / "openvino_model.bin").write_bytes(b"\0" * 100)
    (tmp_path / "openvino_tokenizer.bin").write_bytes(b"\0" * 7)
    (tmp_path / "openvino_detokenizer.bin").write_bytes(b"\0" * 5)
    (tmp_path / "openvino_model.xml").write_text("<net/>")
    assert openvino_anchor.ir_weight_bytes(str(tmp_path)) == 100


STAND_IN_CHILD = r"""
import json, sys
spec = json.load(open(sys.argv[1]))
json.dump(spec, open(spec["model"] + "/spec.json", "w"))
short = spec["properties"].get("short_by", 0)
cases = {c["name"]: {"seconds": 0.5, "tokens": sum(c["max_tokens"]) - short,
                     "prompt_tokens": [len(p) for p in c["prompts"]],
                     "output_tokens": [n - short for n in c["max_tokens"]], "texts": []} for c in spec["cases"]}
print("OPENVINO_RESULT " + json.dumps({"load_s": 1.0, "cores": {}, "rss_gib": 0.1, "cases": cases}))
"""


def test_run_openvino_sends_the_same_token_ids_and_checks_the_counts(tmp_path, monkeypatch):
    child = tmp_path / "child.py"
    child.write_text(STAND_IN_CHILD)
    monkeypatch.setattr(openvino_anchor, "OPENVINO_CHILD_PATH", str(child))
    prompts = [[11, 12, 13], [14, 15]]
    cases = [OpenVinoCase("b2", prompts, [3, 5]), OpenVinoCase("json", prompts[:1], [4], {"type": "object"})]
    r = openvino_anchor.run_openvino(sys.executable, str(tmp_path), "bfloat16", cases, repeats=2)
    assert r["cases"]["b2"] == OpenVinoCaseResult(0.5, 8, [3, 2], [3, 5], [])
    sent = json.loads((tmp_path / "spec.json").read_text())
    assert [c["prompts"] for c in sent["cases"]] == [prompts, prompts[:1]]  # the ids themselves, unchanged
    assert sent["cases"][1]["schema"] == {"type": "object"} and sent["precision"] == "bf16"
    assert sent["max_num_seqs"] == 2 and sent["repeats"] == 2
    with pytest.raises(ValueError, match="generated"):
        openvino_anchor.run_openvino(sys.executable, str(tmp_path), "float32", cases, 1, {"short_by": 1})


def test_run_openvino_reports_a_failed_child(tmp_path, monkeypatch):
    child = tmp_path / "child.py"
    child.write_text("import sys\nprint('no such model', file=sys.stderr)\nsys.exit(3)\n")
    monkeypatch.setattr(openvino_anchor, "OPENVINO_CHILD_PATH", str(child))
    with pytest.raises(RuntimeError, match=r"exit 3\):\nno such model"):
        openvino_anchor.run_openvino(sys.executable, str(tmp_path), "float32", [OpenVinoCase("a", [[1]], [1])], 1)


def test_run_openvino_refuses_token_ids_for_a_vlm_ir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {}, "text_config": {}}))
    with pytest.raises(RuntimeError, match="vision-language model's IR"):
        openvino_anchor.run_openvino("/no/python", str(tmp_path), "float32", [OpenVinoCase("a", [[1]], [1])], 1)


def test_quantized_rows_and_ratios_against_openvino():
    ours = {"1": 20.0, "32": 400.0, "rss_gib": 1.5}
    int8 = {"1": 10.0, "32": 500.0, "rss_gib": 0.9}
    assert quantized.ratios(ours, int8, [1, 32]) == "b1 2.00x, b32 0.80x"
    assert quantized.ratios(ours, "failed: x", [1, 32]) == "n/a (failed: x)"
    row = quantized.table_row("int8", "openvino int8 weights", int8, {"1": 8.0, "32": 400.0}, 2**29, 2**30, [1, 32])
    assert row == "| int8 | openvino int8 weights | 0.50 (0.50x) | 0.90 | 10.0 | 1.25x | 500.0 | 1.25x |"
    assert (
        quantized.table_row("int8", "openvino", "failed: y", None, None, 2**30, [1])
        == "| int8 | openvino | - | failed: y |"
    )


def test_mm_serve_table_puts_openvino_offline_beside_the_servers(capsys):
    served = {"request_throughput": 3.0, "output_throughput": 96.0, "median_ttft_ms": 100.0, "completed": 4}
    offline = {"request_throughput": 2.0, "output_throughput": 64.0, "completed": 4, "failed": 0}
    rows = [
        mm_serve.Row("img224", "vlserve", served, 91),
        mm_serve.Row("img224", mm_openvino.OFFLINE_SERVER, offline, 98, "all requests submitted at once"),
        mm_serve.Row("video", mm_openvino.OFFLINE_SERVER, {}, None, "not run: the offline run sends images only"),
    ]
    mm_serve.print_table(rows, "header")
    out = capsys.readouterr().out
    assert "| img224 | OpenVINO GenAI (offline) (all requests submitted at once) | 98 | 4/4 | 2.00 | 64.0 | - |" in out
    assert re.search(r"^\| img224 \| ratio vlserve served / OpenVINO offline \| \| \| 1\.50x \| 1\.50x \|", out, re.M)
    assert "| video | OpenVINO GenAI (offline) (not run: the offline run sends images only) | - | - |" in out


def test_mm_offline_runs_single_square_image_workloads_only():
    w = mm_serve.WORKLOADS
    assert mm_openvino.offline_unsupported(w["img224"]) is None
    assert mm_openvino.offline_unsupported(w["img896"]) is None
    assert "one square image" in mm_openvino.offline_unsupported(w["img448x4"])
    assert "images only" in mm_openvino.offline_unsupported(w["video"])


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(OPENVINO_PYTHON), reason="the OpenVINO anchor venv is not installed")
@pytest.mark.skipif(
    not os.path.exists(os.path.join(shared_tools_dir(), "openvino-export.py")),
    reason="no shared/tools/openvino-export.py beside this checkout (a clone elsewhere has none)",
)
def test_throughput_with_openvino_on_a_tiny_model(tmp_path, capsys):
    throughput.main(
        ["--hidden-size", "64", "--num-layers", "1", "--num-prompts", "3", "--input-len", "6", "--output-len", "4"]
        + ["--skip-hf", "--repeats", "1", "--threads", "1", "--openvino-python", OPENVINO_PYTHON]
        + ["--openvino-export-dir", str(tmp_path)]
    )
    out = capsys.readouterr().out
    ov = re.search(r"^OpenVINO GenAI: +([\d.]+) tok/s, ([\d.]+) ms/token per stream +\((\d+) tokens", out, re.M)
    assert ov, out
    assert float(ov.group(1)) > 0 and int(ov.group(3)) == 3 * 4
    assert re.search(r"^ratio vlserve/OpenVINO: \d+\.\d+x$", out, re.M)
    assert re.search(r"INFERENCE_PRECISION_HINT f32", out)
    assert [d for d in os.listdir(tmp_path) if d.endswith("-fp32")]  # the export, cached by checkpoint and format
