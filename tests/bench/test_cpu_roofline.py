"""The CPU roofline of the throughput bench: its FLOP count agrees with torch's FLOP counter on the HF model, and
the bench prints it with each engine's share."""

import re

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

from vlserve.bench import throughput
from vlserve.bench.cpu_report import CpuRoofline, format_roofline, run_gbytes, run_gflop
from vlserve.demo.checkpoints import build_text_checkpoint


def test_run_gflop_matches_the_flop_counter_of_one_token(tmp_path):
    # one prompt token and one output token: one forward of one position, whose every matmul torch counts
    # (eager attention: q.k and p.v of the one position), GQA included. The decoder layers and the logits count;
    # the rotary embedding's frequency product (inv_freq x positions) is not work on weights, and whether the counter
    # sees it at all depends on what ran before in the process
    build_text_checkpoint(
        str(tmp_path),
        arch="qwen2",
        hidden_size=96,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=200,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.tensor([[3]]))
    cfg = AutoConfig.from_pretrained(str(tmp_path))
    per_module = counter.get_flop_counts()
    counted = sum(
        sum(ops.values()) for name, ops in per_module.items() if re.fullmatch(r".*\.layers\.\d+|.*\.lm_head", name)
    )
    assert counted > 0
    assert round(run_gflop(cfg, [1], [1]) * 1e9) == counted


def test_run_gflop_counts_fed_back_tokens_and_growing_contexts(tmp_path):
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
    cfg = AutoConfig.from_pretrained(str(tmp_path))
    one = run_gflop(cfg, [1], [1])
    # a second prompt token costs one more pass through the projections and a longer context; a second output
    # token likewise (it is fed back), plus one more row of logits
    longer_prompt = run_gflop(cfg, [2], [1]) - one
    longer_output = run_gflop(cfg, [1], [2]) - one
    logits_row = 2 * 64 * cfg.vocab_size / 1e9
    assert abs(longer_output - longer_prompt - logits_row) < 1e-12
    assert run_gflop(cfg, [4, 4], [3, 3]) == 2 * run_gflop(cfg, [4], [3])
    # a cached prompt token costs neither its projections nor its own context, only the one more position the
    # next token reads (scores and sums: 4 * head_dim FLOPs per head and layer)
    assert abs(run_gflop(cfg, [2], [1], cached_lens=[1]) - one - 4 * 32 * 2 * 2 / 1e9) < 1e-12
    full = run_gflop(cfg, [5], [3])
    assert run_gflop(cfg, [5], [3], cached_lens=[4]) < run_gflop(cfg, [5], [3], cached_lens=[2]) < full


def test_run_gbytes_reads_the_weights_every_step_and_each_decodes_context(tmp_path):
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
    cfg = AutoConfig.from_pretrained(str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    # every weight matrix but the embedding (a lookup reads one row a token); the logits' projection is one even if tied
    matrices = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in name)
    if cfg.tie_word_embeddings:
        matrices += cfg.vocab_size * 64
    assert run_gbytes(cfg, [5], [1], 2) * 1e9 == 2 * matrices  # a prefill step alone: no cached K/V read
    kv_per_position = 2 * 2 * 1 * 32  # K and V, 2 layers, 1 KV head, head_dim 32
    # two more tokens: two decode steps, over 6 and 7 positions
    assert (
        round((run_gbytes(cfg, [5], [3], 2) - 3 * run_gbytes(cfg, [5], [1], 2)) * 1e9) == 2 * (6 + 7) * kv_per_position
    )


def test_format_roofline_takes_the_larger_floor():
    roof = CpuRoofline(
        gflop=100.0, peak_gflops=200.0, shape=(2048, 512, 1536), generated=1000, gbytes=1.0, bandwidth_gbs=10.0
    )
    assert roof.bound == "compute" and roof.ceiling_tok_s == 2000.0
    line = format_roofline(roof, {"vlserve": 1500.0, "vLLM": 500.0})
    assert "compute-bound -> at most 2000 tok/s; vlserve 75%, vLLM 25% of it" in line and "cached" not in line
    roof.cached = True
    assert "per run (prompts cached but their last token" in format_roofline(roof, {"vlserve": 1500.0})
    slow_memory = CpuRoofline(100.0, 200.0, (2048, 512, 1536), 1000, gbytes=10.0, bandwidth_gbs=10.0)
    assert slow_memory.bound == "memory" and slow_memory.ceiling_tok_s == 1000.0


def test_throughput_bench_prints_the_cpu_roofline(capsys):
    throughput.main(
        [
            "--hidden-size",
            "64",
            "--num-layers",
            "1",
            "--num-prompts",
            "2",
            "--input-len",
            "5",
            "--output-len",
            "3",
            "--threads",
            "1",
            "--repeats",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert re.search(
        r"CPU roofline: \d+\.\d GFLOP .* GB/s = .*-bound -> at most \d+ tok/s; vlserve \d+%, HF \d+% of it", out
    )
