"""The offline throughput benchmark runs end to end and counts the same (requested) tokens for every engine."""

import re

from vlserve.bench import throughput


def test_throughput_bench_counts_requested_tokens_with_varied_lengths(capsys):
    throughput.main(
        [
            "--hidden-size",
            "64",
            "--num-layers",
            "1",
            "--num-prompts",
            "5",
            "--input-len-range",
            "3",
            "20",
            "--output-len-range",
            "2",
            "9",
            "--threads",
            "1",
            "--seed",
            "3",
        ]
    )
    out = capsys.readouterr().out
    vl = int(re.search(r"vlserve: .*\((\d+) tokens", out).group(1))
    hf = int(re.search(r"HF generate: .*\((\d+) tokens", out).group(1))
    assert vl == hf  # HF runs each batch to its longest request but is credited only with what was asked for
    assert 5 * 2 <= vl <= 5 * 9 and vl != 5 * 9  # per-request lengths drawn from the range, not all the maximum
    generated = int(re.search(r"it generated (\d+)", out).group(1))
    assert generated > hf  # the extra tokens HF ran to reach the longest request are reported, not credited
    assert re.search(r"ratio vlserve/HF: \d+\.\d+x", out)


def test_throughput_bench_fixed_lengths(capsys):
    throughput.main(
        [
            "--hidden-size",
            "64",
            "--num-layers",
            "1",
            "--num-prompts",
            "3",
            "--input-len",
            "7",
            "--output-len",
            "4",
            "--threads",
            "1",
            "--num-heads",
            "2",
            "--num-kv-heads",
            "1",
            "--intermediate-size",
            "96",
            "--block-size",
            "32",
        ]
    )
    out = capsys.readouterr().out
    assert "hidden 64, 1 layers, 2 heads / 1 KV heads, intermediate 96" in out
    assert "block size 32" in out.split("vlserve:")[1]  # vLLM-CPU's smallest, for a like-for-like prefix cache
    assert "(12 tokens" in out.split("HF generate:")[0] and "(12 tokens" in out.split("HF generate:")[1]


def test_throughput_bench_on_a_vlm_with_eager_comparison(capsys):
    from vlserve.demo import default_model_path

    # the demo model is a Qwen2-VL: its vocab and sizes live in text_config
    throughput.main(
        [
            "--model",
            default_model_path(),
            "--num-prompts",
            "2",
            "--input-len",
            "5",
            "--output-len",
            "3",
            "--threads",
            "1",
            "--skip-hf",
            "--compare-eager",
            "-O0",
        ]
    )
    out = capsys.readouterr().out
    assert "hidden 192, 4 layers, " in out
    assert re.search(r"vlserve eager: .*\(6 tokens in .*, \d+ steps, \d+\.\d+ ms/step", out)
    assert re.search(r"vlserve: .*\(6 tokens .* compile 0\.0 s; compilation 0.*; block size 16\)", out)
    assert re.search(r"ratio vlserve/vlserve-eager: \d+\.\d+x", out)
