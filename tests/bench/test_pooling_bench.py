"""benchmarks.pooling: its CLIP tokenizer, its workloads, its table (ratios, cosines against HF, runners that
cannot serve a model), its arguments, and (slow) a `--quick --no-vllm` run end to end: vlserve, HF and
sentence-transformers on the tiny Qwen2-VL embedder and CLIP."""

import json
import os

import numpy as np
import pytest

from benchmarks import pooling
from benchmarks.pooling_checkpoints import WORDS, clip_checkpoint, clip_tokenizer, qwen2_vl_embedder


def test_clip_tokenizer_spells_each_word_as_one_token_with_specials_last():
    tok = clip_tokenizer()
    ids = tok(" ".join(WORDS))["input_ids"]
    assert len(ids) == len(WORDS) + 2  # start, one per word, end
    assert len(set(ids[1:-1])) == len(set(WORDS))
    assert sorted(tok.all_special_ids) == [len(tok) - 2, len(tok) - 1]
    assert 0 not in tok.all_special_ids  # vLLM's CLIP uses id 0 as its image placeholder


def test_clip_checkpoint_loads_with_its_processor(tmp_path):
    from transformers import AutoConfig, AutoProcessor

    path = clip_checkpoint(str(tmp_path), quick=True)
    assert clip_checkpoint(str(tmp_path), quick=True) == path  # cached
    config = AutoConfig.from_pretrained(path)
    assert config.text_config.hidden_size == config.projection_dim == config.text_config.projection_dim
    processor = AutoProcessor.from_pretrained(path)
    image = np.zeros((240, 320, 3), dtype=np.uint8)
    pixels = processor(images=[image], return_tensors="pt")["pixel_values"]
    assert pixels.shape[-2:] == (config.vision_config.image_size,) * 2


def test_workloads_mix_image_sizes_and_apply_the_chat_template(tmp_path):
    model = qwen2_vl_embedder(str(tmp_path), quick=True)
    workloads = pooling.prepare_sets("qwen2_vl", model, {"images": 5, "texts": 3}, str(tmp_path), seed=0)
    by_name = {w["name"]: w["sets"] for w in workloads}
    images = np.load(by_name["images"]["main"]["images"])
    sizes = [images[str(i)].shape[:2] for i in range(5)]
    expected = [(h, w) for w, h in pooling.IMAGE_SIZES]
    assert sizes == [expected[i % len(expected)] for i in range(5)]
    for prompt in by_name["images"]["main"]["prompts"]:
        assert prompt.count("<|image_pad|>") == 1 and pooling.IMAGE_INSTRUCTION in prompt
    texts = by_name["texts"]
    assert texts["main"]["images"] is None and len(texts["warmup"]["prompts"]) == 3
    assert not set(texts["main"]["prompts"]) & set(texts["warmup"]["prompts"])  # the warm-up embeds other items
    for prompt in texts["main"]["prompts"]:
        assert "<|image_pad|>" not in prompt and prompt.rstrip().endswith("assistant")
    clip = pooling.prepare_sets("clip", model, {"images": 2, "texts": 2}, str(tmp_path), seed=0)
    assert clip[0]["sets"]["main"]["prompts"] == ["", ""]
    words = clip[1]["sets"]["main"]["prompts"][0].split()
    assert 8 <= len(words) <= 32 and set(words) <= set(WORDS)


def _result(rate: float, first: list, calls=None) -> dict:
    images = {"items_per_s": rate, "seconds": 1.0, "tower_calls": calls, "images_encoded": 2, "first": first}
    return {"workloads": {"images": images}}


def test_table_rows_ratios_cosines_and_unsupported_runners():
    workloads = [{"name": "images", "sets": {"main": {"prompts": ["", ""]}}}]
    hf_first = [[1.0, 0.0], [0.0, 1.0]]
    results = {
        "hf": _result(10.0, hf_first),
        "vlserve": _result(25.0, [[1.0, 0.0], [1.0, 0.0]], calls=1),  # its second embedding is wrong
        "st": "failed (exit 1): boom",
        "vllm": {"unsupported": "ValueError: no CLIP"},
    }
    (row,) = pooling.table_rows(results, workloads)
    assert row["vlserve_over_hf"] == pytest.approx(2.5) and row["vlserve_over_vllm"] is None
    assert row["runners"]["vlserve"]["min_cosine_vs_hf"] == pytest.approx(0.0)
    assert row["runners"]["hf"]["min_cosine_vs_hf"] == pytest.approx(1.0)
    assert row["hf_max_cosine_between_items"] == pytest.approx(0.0)
    text = pooling.format_table("title", [row], ["vlserve", "hf", "st", "vllm"])
    assert "| images (2) | 25.00 | 10.00 | - | - | 2.50x | - |" in text
    assert "vLLM-CPU: not supported (ValueError: no CLIP)" in text
    assert "sentence-transformers: failed (exit 1): boom" in text
    assert text.splitlines()[3].endswith("| 1 / 2 |")  # vlserve's tower calls / images encoded


def test_args_quick_sizes_no_vllm_and_hf_always_in():
    args = pooling.parse_args(["--quick", "--no-vllm", "--runners", "vlserve", "vllm"])
    assert (args.images, args.texts) == (3, 4)
    assert args.runners == ["vlserve", "hf"]
    full = pooling.parse_args([])
    assert (full.images, full.texts) == (64, 256) and full.runners == list(pooling.RUNNERS)
    assert full.dtype == ["float32", "bfloat16"]
    with pytest.raises(SystemExit):
        pooling.parse_args(["--images", "0", "--texts", "0"])


def test_rounds_keep_each_runners_best_round_and_its_first_embeddings():
    first = {"load_s": 1.0, "workloads": {"texts": {"items_per_s": 10.0, "first": [[1.0]]}}}
    second = {
        "load_s": 1.0,
        "workloads": {"texts": {"items_per_s": 12.0, "first": [[2.0]]}, "images": {"items_per_s": 3.0}},
    }
    kept = pooling.keep_faster(pooling.keep_faster(None, first), second)
    assert kept["workloads"]["texts"] == {"items_per_s": 12.0, "first": [[1.0]], "rounds": [10.0, 12.0]}
    assert kept["workloads"]["images"] == {"items_per_s": 3.0}
    slower = {"workloads": {"texts": {"items_per_s": 11.0, "first": [[3.0]]}}}
    assert pooling.keep_faster(kept, slower)["workloads"]["texts"]["items_per_s"] == 12.0
    assert kept["workloads"]["texts"]["rounds"] == [10.0, 12.0, 11.0]
    assert pooling.keep_faster(kept, "child failed") is kept  # a failed round keeps what the others measured
    assert pooling.keep_faster("child failed", first) is first
    assert pooling.parse_args(["--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        pooling.parse_args(["--rounds", "0"])


@pytest.mark.slow
def test_quick_run_without_vllm(tmp_path, capsys):
    out = tmp_path / "results.json"
    argv = ["--quick", "--no-vllm", "--dtype", "float32", "--ceiling", "--workdir", str(tmp_path), "--out", str(out)]
    report = pooling.main(argv)
    text = capsys.readouterr().out
    assert "Qwen2-VL embedder (tiny" in text and "CLIP (tiny" in text
    assert json.loads(out.read_text())["tables"][0]["rows"] == report["tables"][0]["rows"]
    qwen = {r["workload"]: r for r in report["tables"][0]["rows"]}
    for name in ("images", "texts"):
        for runner in ("vlserve", "hf", "st"):
            cells = qwen[name]["runners"][runner]
            assert cells["items_per_s"] > 0 and cells["min_cosine_vs_hf"] > 0.999, (name, runner, cells)
        assert qwen[name]["vlserve_over_hf"] > 0
    ours = qwen["images"]["runners"]["vlserve"]
    assert 1 <= ours["tower_calls"] <= ours["images_encoded"] == 3
    clip = {r["workload"]: r for r in report["tables"][1]["rows"]}
    for name in ("images", "texts"):
        assert clip[name]["runners"]["hf"]["items_per_s"] > 0
        ours = clip[name]["runners"]["vlserve"]
        assert ours.get("min_cosine_vs_hf", 1.0) > 0.999  # served and right, or
        assert "items_per_s" in ours or "CLIP not served by this build" in ours["error"]
    assert os.path.exists(tmp_path / "qwen2_vl-float32-vlserve.log")
    # --ceiling: a vlserve process of its own counted the linears of each first pass (none hit a cache)
    assert text.count("ceiling at this CPU's peak") == 2 and "no FLOP count" not in text
    assert text.count("vlserve's linears") == 4


def test_ceiling_lines_compare_the_goal_with_the_flops_at_peak(monkeypatch):
    import benchmarks.cpu_peak

    monkeypatch.setattr(benchmarks.cpu_peak, "peak_gflops", lambda dtype: 100.0)
    rows = [
        {"workload": "images", "runners": {"hf": {"items_per_s": 10.0}, "vllm": {"items_per_s": 20.0}}},
        {"workload": "texts", "runners": {"hf": {"items_per_s": 5.0}}},
    ]
    ours = {"workloads": {"images": {"items": 64, "items_per_s": 24.0}, "texts": {"items": 8, "items_per_s": 9.0}}}
    counted = {"workloads": {"images": {"linear_gflop": 200.0}, "texts": {"linear_gflop": 0.2}}}
    text = pooling.ceiling_lines(rows, ours, counted, "float32")
    # images: 200 GFLOP at 100 GFLOP/s is 2 s, 32 items/s at most; the goal asks max(2 x 10, 1.3 x 20) = 26
    assert "- images: vlserve's linears 200.0 GFLOP: <= 32.00 items/s; vlserve 24.00 (75%)" in text
    assert "2x HF 20.00, 1.3x vLLM 26.00: 81% of the ceiling" in text
    counted["workloads"]["images"]["linear_gflop"] = 400.0  # 16 items/s at most: the goal is past it
    assert "1.3x vLLM 26.00: past the ceiling" in pooling.ceiling_lines(rows, ours, counted, "float32")
    assert "- texts: no FLOP count (failed: boom)" in pooling.ceiling_lines(rows, ours, "failed: boom", "float32")
