"""benchmarks.realsize: its work accounting against torch's FLOP counter on HF's modules, its table, the anchor
environment (every core bound for vLLM-CPU), --quantized (arguments, labels, each engine's checkpoint), and (slow) tiny
end-to-end runs through vlserve, the second quantized beside OpenVINO's int8 weights."""

import json
import os
import subprocess
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import realsize_quant
from benchmarks.realsize import QWEN2_VL_2B, TINY, checkpoint_spec, parse_args
from benchmarks.realsize_quant import check_same_model, check_w8a8_checkpoint, engine_checkpoint, quantized_labels
from benchmarks.realsize_table import check_counts, format_table, result_rows
from benchmarks.realsize_work import (
    MachineLimits,
    WorkloadWork,
    decode_bytes,
    decode_flops,
    prefill_flops,
    vision_flops,
)
from vlserve.bench import anchor_env


def _counted(module, *args, **kwargs) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        module(*args, **kwargs)
    return counter.get_total_flops()


def test_vision_flops_match_torch_counter_on_hf_tower():
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    vision = dict(depth=2, embed_dim=64, hidden_size=96, num_heads=2, mlp_ratio=4, patch_size=14)
    cfg = Qwen2VLConfig(vision_config=vision).vision_config
    cfg._attn_implementation = "eager"  # the counter sees eager attention's matmuls
    tower = Qwen2VisionTransformerPretrainedModel._from_config(cfg).eval()
    for t, h, w in [(1, 4, 6), (1, 8, 8)]:
        pixels = torch.randn(t * h * w, 3 * 2 * 14 * 14)
        assert vision_flops(cfg, [(t, h, w)]) == _counted(tower, pixels, grid_thw=torch.tensor([[t, h, w]]))


def test_prefill_flops_match_torch_counter_on_hf_decoder_with_causal_attention():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    model = Qwen2ForCausalLM(cfg).eval()
    head_dim = 64 // 4
    for length in (1, 7):
        ids = torch.randint(0, 300, (1, length))
        counted = _counted(model, input_ids=ids, logits_to_keep=1)
        # eager attention multiplies the full square of scores; the causal work is the lower triangle
        masked = 4 * head_dim * 4 * 2 * (length * length - length * (length + 1) // 2)
        assert prefill_flops(cfg, [length]) == counted - masked


def test_decode_accounting_by_hand():
    cfg = SimpleNamespace(
        hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16, num_hidden_layers=3,
        vocab_size=50,
    )  # fmt: skip
    head_dim, layer_weights = 4, 8 * (2 + 2) * 4 + 2 * 4 * 8 + 3 * 8 * 16
    # prompts of 5 and 6 tokens, 3 outputs: 2 decode steps each, the fed-back token at positions p, p + 1
    fed_back = 2 * 2
    contexts = (6 + 7) + (7 + 8)
    want = 2 * fed_back * 3 * layer_weights + 2 * fed_back * 8 * 50 + 4 * contexts * 2 * head_dim * 3
    assert decode_flops(cfg, [5, 6], 3) == want
    weights = 3 * layer_weights + 8 * 50
    kv_positions = (5 + 1) + (5 + 2) + (6 + 1) + (6 + 2)
    assert decode_bytes(cfg, [5, 6], 3, 2) == 2 * weights * 2 + kv_positions * 2 * 3 * 1 * head_dim * 2


def _work(decode_bytes_: float = 4e9) -> WorkloadWork:
    return WorkloadWork(4, 9, 1e12, 1e12, 1e11, decode_bytes_)


def test_ideal_times_take_the_binding_limit():
    limits = MachineLimits({"bfloat16": 1000.0, "float32": 250.0}, read_gbs=20.0, gemm_size=64)
    bf16 = _work().ideal(limits, "bfloat16")
    assert bf16["first_tokens_s"] == pytest.approx(2.0)
    assert bf16["decode_s"] == pytest.approx(0.2)  # 4 GB at 20 GB/s > 0.1 TFLOP at 1 TFLOP/s
    f32 = _work().ideal(limits, "float32")
    assert f32["decode_s"] == pytest.approx(0.4)  # now compute-bound
    assert f32["total_s"] == pytest.approx(8.4)


def _child(total_s: float, outputs: list[int], prompts: list[int]) -> dict:
    m = {
        "ttft_pass_s": 1.0,
        "total_s": total_s,
        "prompt_tokens": prompts,
        "output_tokens": outputs,
        "ttft_pass_output_tokens": [1] * len(outputs),
        "engine_mean_ttft_s": None,
    }
    return {"load_s": 1.0, "cores": {}, "workloads": {"image": m}}


def test_rows_ratio_to_the_faster_anchor_fractions_and_count_checks():
    workload = SimpleNamespace(requests=4, max_tokens=9, prompt_lens=[30, 31, 30, 32])
    results = {
        ("bfloat16", "vlserve"): _child(4.0, [9] * 4, [30, 31, 30, 32]),
        ("bfloat16", "vllm"): _child(8.0, [9] * 4, [30, 31, 30, 32]),
        ("bfloat16", "openvino"): _child(5.0, [9, 9, 8, 9], [30, 31, 30, 32]),
    }
    limits = MachineLimits({"bfloat16": 1000.0}, read_gbs=20.0, gemm_size=64)
    rows = result_rows(results, {"image": workload}, {("image", "bfloat16"): _work()}, limits)
    by_engine = {r["engine"]: r for r in rows}
    assert by_engine["vlserve"]["req_s"] == pytest.approx(1.0)
    assert by_engine["vlserve"]["vs_faster_anchor"] == pytest.approx(5.0 / 4.0)  # OpenVINO's 0.8 req/s
    assert by_engine["vllm"]["vs_faster_anchor"] == pytest.approx(0.625)
    assert by_engine["vlserve"]["decode_tok_s"] == pytest.approx(4 * 8 / 3.0)
    assert by_engine["vlserve"]["fraction"]["first_tokens"] == pytest.approx(2.0)
    assert by_engine["vlserve"]["fraction"]["total"] == pytest.approx(2.2 / 4.0)
    assert by_engine["vlserve"]["counts"] == "ok"
    assert "output tokens [8, 9] != 9" in by_engine["openvino"]["counts"]
    table = format_table(rows)
    assert table.count("\n") == 4 and "OpenVINO GenAI" in table and "1.25x" in table
    quantized = result_rows(
        results, {"image": workload}, {("image", "bfloat16"): _work()}, limits, quantized_labels({})
    )
    assert [r["label"] for r in quantized] == ["vlserve W8A8", "vLLM-CPU W8A8", "OpenVINO int8 weights"]
    assert "| OpenVINO int8 weights |" in format_table(quantized) and "OpenVINO GenAI" not in format_table(quantized)


def test_count_check_catches_prompts_and_batch_totals():
    m = _child(1.0, [4, 4], [10, 11])["workloads"]["image"]
    assert check_counts(m, [10, 11], 4) == "ok"
    assert "prompt tokens" in check_counts(m, [10, 12], 4)
    assert "generated 9 tokens" in check_counts({**m, "batch_output_tokens": 9}, [10, 11], 4)


def test_a_failed_engine_gets_its_row():
    workload = SimpleNamespace(requests=2, max_tokens=3, prompt_lens=[5, 5])
    limits = MachineLimits({"float32": 100.0}, read_gbs=10.0, gemm_size=64)
    rows = result_rows({("float32", "vllm"): "failed (exit 1): boom"}, {"image": workload}, {
        ("image", "float32"): _work()}, limits)  # fmt: skip
    assert rows[0]["error"] == "failed (exit 1): boom"
    assert "boom" in format_table(rows)


def test_checkpoint_spec_has_qwen2_vl_2b_shapes_and_overrides():
    spec = checkpoint_spec(tiny=False, override=None)
    assert (spec["vision_depth"], spec["vision_embed_dim"], spec["vision_num_heads"]) == (32, 1280, 16)
    assert (spec["hidden_size"], spec["num_layers"], spec["intermediate_size"]) == (1536, 28, 8960)
    assert spec["text_overrides"]["vocab_size"] == 151936 and spec["vision_overrides"]["mlp_ratio"] == 4
    assert spec["tie_word_embeddings"] and spec["dtype"] == "bfloat16"
    tiny = checkpoint_spec(tiny=True, override={"num_layers": 3})
    assert tiny["num_layers"] == 3 and tiny["hidden_size"] == TINY["hidden_size"]
    assert tiny["text_overrides"] == QWEN2_VL_2B["text_overrides"]


def test_vllm_env_binds_every_core_this_process_may_use():
    cores = sorted(os.sched_getaffinity(0))
    env = anchor_env.vllm_cpu_env()
    assert anchor_env.parse_cpu_list(env["VLLM_CPU_OMP_THREADS_BIND"]) == cores
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["HF_HUB_OFFLINE"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in anchor_env.vllm_cpu_env("auto")
    assert anchor_env.vllm_cpu_env("0,1,2,5")["VLLM_CPU_OMP_THREADS_BIND"] == "0-2,5"


def test_cpu_lists_round_trip():
    assert anchor_env.format_cpu_list([5, 0, 2, 1]) == "0-2,5"
    assert anchor_env.parse_cpu_list("0-2,5") == [0, 1, 2, 5]
    with pytest.raises(ValueError):
        anchor_env.format_cpu_list([])


def test_process_tree_cores_sees_a_pinned_child():
    core = min(os.sched_getaffinity(0))
    child = subprocess.Popen(["sleep", "30"], preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    try:
        cores = anchor_env.process_tree_cores()
        mine = next(v for k, v in cores.items() if k.endswith(f"[{child.pid}]"))
        assert mine == f"main {core}; threads {core} x1"
    finally:
        child.kill()
        child.wait()


def test_cores_probe_runs_in_a_bare_python():
    """A child in an anchor's venv loads the probe from its file path, without vlserve."""
    script = anchor_env.CORES_PROBE + "\nimport json\nprint(json.dumps(engine_cores()))\n"
    out = subprocess.run(["python3", "-c", script], capture_output=True, text=True, cwd="/", check=True)
    assert any(k.startswith("python3[") for k in json.loads(out.stdout))


W8A8_CONFIG = {
    "quant_method": "compressed-tensors",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
        }
    },
}


def _checkpoint_dir(path, quantization_config: dict | None) -> str:
    os.makedirs(path, exist_ok=True)
    config = {"model_type": "qwen2_vl"} | ({"quantization_config": quantization_config} if quantization_config else {})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def test_quantized_args_default_to_bfloat16_and_refuse_float32_and_non_w8a8(tmp_path, capsys):
    w8a8 = _checkpoint_dir(tmp_path / "w8a8", W8A8_CONFIG)
    assert parse_args([]).dtypes == ["bfloat16", "float32"] and parse_args([]).quantized is None
    args = parse_args(["--quantized", w8a8, "--vlserve-kwargs", '{"mm_encoder_quantization": "int8"}'])
    assert args.dtypes == ["bfloat16"] and args.quantized == w8a8
    assert args.vlserve_kwargs == {"mm_encoder_quantization": "int8"}
    with pytest.raises(SystemExit):
        parse_args(["--quantized", w8a8, "--dtypes", "bfloat16,float32"])
    assert "--dtypes must be bfloat16" in capsys.readouterr().err
    w4a16 = json.loads(json.dumps(W8A8_CONFIG))
    w4a16["config_groups"]["group_0"] |= {"weights": {"num_bits": 4, "type": "int"}, "input_activations": None}
    for path, why in (
        (str(tmp_path / "missing"), "no config.json"),
        (_checkpoint_dir(tmp_path / "bf16", None), "not a compressed-tensors checkpoint"),
        (_checkpoint_dir(tmp_path / "w4a16", w4a16), "weights are not INT8"),
        (_checkpoint_dir(tmp_path / "empty", {"quant_method": "compressed-tensors"}), "no scheme groups"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["--quantized", path])
        assert why in capsys.readouterr().err
    fp8 = json.loads(json.dumps(W8A8_CONFIG))
    fp8["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "float"}
    with pytest.raises(ValueError, match="input activations are not INT8"):
        check_w8a8_checkpoint(_checkpoint_dir(tmp_path / "fp8", fp8))


def test_quantized_labels_name_the_towers_only_when_asked():
    assert quantized_labels({"mm_encoder_quantization": "int8"})["vlserve"] == "vlserve W8A8 + INT8 towers"
    assert quantized_labels({})["vlserve"] == "vlserve W8A8"
    assert quantized_labels({}) | {"vlserve": "-"} == {
        "vlserve": "-", "vllm": "vLLM-CPU W8A8", "openvino": "OpenVINO int8 weights"}  # fmt: skip


def test_each_engine_gets_its_checkpoint(monkeypatch):
    exports = []
    monkeypatch.setattr(realsize_quant, "openvino_export", lambda *a: exports.append(a) or f"ir-{a[-1]}")
    assert engine_checkpoint("vlserve", "/base", "/w8a8", "bfloat16", "/ov") == "/w8a8"
    assert engine_checkpoint("vllm", "/base", "/w8a8", "bfloat16", "/ov") == "/w8a8"
    assert engine_checkpoint("openvino", "/base", "/w8a8", "bfloat16", "/ov", "py") == "ir-int8"
    assert engine_checkpoint("vlserve", "/base", None, "float32", "/ov") == "/base"
    assert engine_checkpoint("openvino", "/base", None, "float32", "/ov") == "ir-None"
    assert exports == [("/base", "bfloat16", "/ov", "py", "int8"), ("/base", "float32", "/ov", None, None)]


def test_the_quantized_copy_must_have_the_base_checkpoints_shapes(tmp_path):
    from transformers import Qwen2VLConfig

    vision = {"depth": 2, "embed_dim": 64, "num_heads": 2, "hidden_size": 64}
    text = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 300}
    Qwen2VLConfig(vision_config=vision, **text).save_pretrained(tmp_path / "base")
    Qwen2VLConfig(vision_config=vision, **text).save_pretrained(tmp_path / "copy")
    Qwen2VLConfig(vision_config=vision, **text | {"num_hidden_layers": 3}).save_pretrained(tmp_path / "deeper")
    Qwen2VLConfig(vision_config=vision | {"depth": 3}, **text).save_pretrained(tmp_path / "deeper_tower")
    check_same_model(str(tmp_path / "base"), str(tmp_path / "copy"))
    with pytest.raises(ValueError, match="text num_hidden_layers 3 != 2"):
        check_same_model(str(tmp_path / "base"), str(tmp_path / "deeper"))
    with pytest.raises(ValueError, match="vision depth 3 != 2"):
        check_same_model(str(tmp_path / "base"), str(tmp_path / "deeper_tower"))


@pytest.mark.slow
def test_realsize_runs_end_to_end_on_a_tiny_checkpoint(tmp_path):
    from benchmarks import realsize

    args = ["--tiny", "--engines", "vlserve", "--dtypes", "bfloat16", "--requests", "2", "--text-requests", "2"]
    args += ["--image-size", "112", "--max-tokens", "3", "--text-len", "8", "--gemm-size", "256"]
    report = realsize.main(args + ["--workdir", str(tmp_path), "--out", str(tmp_path / "r.json")])
    assert json.load(open(tmp_path / "r.json"))["rows"] == report["rows"]
    assert [(r["workload"], r["engine"]) for r in report["rows"]] == [("image", "vlserve"), ("text", "vlserve")]
    assert all(r["counts"] == "ok" and r["req_s"] > 0 for r in report["rows"])
    image = report["engines"]["bfloat16/vlserve"]["workloads"]["image"]
    assert image["prompt_tokens"][0] > 16 + 60  # a 112x112 image is 16 placeholder tokens, then ~60 of text


@pytest.mark.slow
def test_realsize_quantized_runs_vlserve_w8a8_beside_openvino_int8_on_a_tiny_checkpoint(tmp_path):
    """The tiny base, quantized W8A8 by llm-compressor (its own venv), through vlserve with INT8 towers and OpenVINO
    GenAI's int8-weight export; both venvs must be installed already."""
    from benchmarks import realsize
    from vlserve.bench.anchor_env import OPENVINO_PYTHON, shared_tools_dir

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    quant_python = os.path.join(root, ".venv-quant/bin/python")
    exporter = os.path.join(shared_tools_dir(), "openvino-export.py")
    if not (os.path.exists(quant_python) and os.path.exists(OPENVINO_PYTHON) and os.path.exists(exporter)):
        pytest.skip(
            "needs .venv-quant (make quant-tools), the OpenVINO anchor venv and shared/tools beside the checkout"
        )
    base = realsize.build_checkpoint(str(tmp_path), checkpoint_spec(tiny=True, override=None))
    w8a8 = str(tmp_path / "w8a8")
    script = os.path.join(root, "examples", "quantize_llmcompressor.py")
    subprocess.run([quant_python, script, base, w8a8, "--scheme", "W8A8"], check=True, capture_output=True)
    args = ["--tiny", "--quantized", w8a8, "--engines", "vlserve,openvino", "--requests", "2", "--text-requests", "2"]
    args += ["--image-size", "112", "--max-tokens", "3", "--text-len", "8", "--gemm-size", "256"]
    args += ["--vlserve-kwargs", '{"mm_encoder_quantization": "int8"}', "--workdir", str(tmp_path)]
    report = realsize.main(args + ["--out", str(tmp_path / "r.json")])
    assert report["checkpoint"]["quantized"] == w8a8
    labels = [(r["workload"], r["label"]) for r in report["rows"]]
    assert labels == [
        ("image", "vlserve W8A8 + INT8 towers"), ("image", "OpenVINO int8 weights"),
        ("text", "vlserve W8A8 + INT8 towers"), ("text", "OpenVINO int8 weights")]  # fmt: skip
    assert all(r["counts"] == "ok" and r["req_s"] > 0 for r in report["rows"])
    engines = report["engines"]
    for name in ("image", "text"):  # the same prompts, token for token, through both engines
        vl, ov = (engines[f"bfloat16/{e}"]["workloads"][name]["prompt_tokens"] for e in ("vlserve", "openvino"))
        assert vl == ov
    assert os.listdir(tmp_path / "openvino") and all(d.endswith("-int8") for d in os.listdir(tmp_path / "openvino"))
