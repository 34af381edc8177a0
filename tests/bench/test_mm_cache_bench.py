"""The encoder-cache benchmark runs end to end on both families it builds, and the cache saves encoder runs."""

import re

import pytest

from vlserve.bench import mm_cache


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_next"])
def test_mm_cache_bench_runs_and_the_cache_saves_encoder_runs(capsys, family):
    mm_cache.main(
        [
            "--family",
            family,
            "--num-requests",
            "6",
            "--num-images",
            "2",
            "--image-size",
            "56",
            "--output-len",
            "2",
            "--vision-depth",
            "1",
            "--vision-width",
            "64",
        ]
    )
    out = capsys.readouterr().out
    on = int(re.search(r"cache on : .* (\d+) encoder runs", out).group(1))
    off = int(re.search(r"cache off: .* (\d+) encoder runs", out).group(1))
    # totals include the warm-up request (image 0): with the cache one run per distinct image, without it one per
    # request
    assert on == 2 and off == 6 + 1
    assert re.search(r"throughput ratio on/off: \d+\.\d+x", out)
