"""Choose the draft proposer for a speculative config."""
from __future__ import annotations

from vlserve.spec_decode.config import SpeculativeConfig
from vlserve.spec_decode.ngram_proposer import NgramProposer


def build_proposer(spec_config: SpeculativeConfig | None, max_model_len: int):
    """The proposer the runner calls after each step, or None when speculative decoding is off."""
    if spec_config is None:
        return None
    if spec_config.use_ngram:
        return NgramProposer.from_config(spec_config, max_model_len)
    raise ValueError(f"speculative method {spec_config.method!r} is not available in this build yet; "
                     f"use {{'method': 'ngram', 'num_speculative_tokens': k}}")
