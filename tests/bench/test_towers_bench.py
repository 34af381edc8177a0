"""benchmarks.towers: on tiny towers it prints a row per family and dtype, ours matching HF's output in each."""

import re

from benchmarks import towers

ROW = re.compile(
    r"^(\w+) +(float32|bfloat16) +(\d+) +(\d+) +([\d.]+) +([\d.]+) +(\d+) +([\d.]+) +([\d.]+) +"
    r"([\d.]+)x  ([\d.e+-]+) (ok|OVER TOLERANCE)$",
    re.M,
)


def test_towers_bench_prints_rows_that_pass_parity(capsys):
    argv = ["--families", "qwen2_5_vl", "siglip", "--depth", "1", "--width", "64", "--image-size", "56", "--iters", "1"]
    argv += ["--head-dim", "32"]
    rows = towers.main(argv)
    out = capsys.readouterr().out
    printed = ROW.findall(out)
    assert [(r[0], r[1]) for r in printed] == [
        ("qwen2_5_vl", "float32"),
        ("qwen2_5_vl", "bfloat16"),
        ("siglip", "float32"),
        ("siglip", "bfloat16"),
    ], out
    assert all(r[11] == "ok" for r in printed) and all(r["ok"] for r in rows), out
    assert all(int(r[2]) == 16 for r in printed)  # (56 / 14)**2 patches
    for line, row in zip(printed, rows):  # the printed ratio is HF's time over ours
        assert float(line[9]) == round(row["hf_ms"] / row["ours_ms"], 2)
        assert row["ours_gflops"] > 0 and row["err"] <= 5e-2
    assert re.search(r"^summary float32: ours/HF geomean [\d.]+x over 2 families .* parity ok$", out, re.M)
    assert re.search(r"^summary bfloat16: ours/HF geomean [\d.]+x over 2 families .* parity ok$", out, re.M)
    assert "allocator tuning" in out and "packed linear kernel: float32 " in out
    assert "width 64, 2 heads of 32," in out
    assert out.rstrip().endswith("command: python -m benchmarks.towers " + " ".join(argv))
