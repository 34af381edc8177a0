"""SpeculativeConfig validation."""

import pytest

from vlserve.spec_decode import SpeculativeConfig


def test_ngram_defaults_and_copying():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max, c.model) == ("ngram", 5, 5, None)
    assert c.use_ngram and not c.use_eagle
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    c = SpeculativeConfig.from_dict(
        {"method": "[ngram]", "num_speculative_tokens": 1, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    )
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 1, 3)


def test_eagle():
    c = SpeculativeConfig.from_dict({"method": "eagle3", "num_speculative_tokens": 2, "model": "/d/eagle3"})
    assert c.use_eagle and c.method == "eagle3" and c.model == "/d/eagle3"
    # method inferred from the draft's name, like vLLM
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "model": "x/EAGLE3-llama"}).method == "eagle3"
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "model": "x/eagle-llama"}).method == "eagle"
    assert SpeculativeConfig.from_dict(None) is None
    assert SpeculativeConfig.from_dict(c) is c


@pytest.mark.parametrize(
    "d, field",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0, "prompt_lookup_min": 1},
            "prompt_lookup_max",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/d"}, "model"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "model"),
        ({"method": "eagle", "num_speculative_tokens": 2, "model": ""}, "model"),
        ({"method": "eagle", "num_speculative_tokens": 2, "model": "/d", "prompt_lookup_min": 2}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "num_lookahead": 3}, "num_lookahead"),
    ],
)
def test_errors_name_the_field(d, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(d)
