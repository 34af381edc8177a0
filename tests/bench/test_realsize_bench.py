"""benchmarks.realsize: its work accounting against torch's FLOP counter on HF's modules, its table, the anchor
environment (every core bound for vLLM-CPU), and (slow) a tiny end-to-end run through vlserve."""

import json
import os
import subprocess
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.realsize import QWEN2_VL_2B, TINY, checkpoint_spec
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
