"""Choose the draft proposer for a speculative config."""

from __future__ import annotations

from vlserve.spec_decode.config import SpeculativeConfig
from vlserve.spec_decode.ngram_proposer import NgramProposer


def build_proposer(spec_config: SpeculativeConfig | None, max_model_len: int, loaded=None, block_size: int = 16):
    """The proposer the runner calls after each step, or None when speculative decoding is off.

    EAGLE methods need the loaded target (`vlserve.engine.model_setup.LoadedModel`) and the KV block size: the
    draft head shares the target's embeddings / lm_head and indexes its KV cache by the target's block tables.
    """
    if spec_config is None:
        return None
    if spec_config.use_ngram:
        return NgramProposer.from_config(spec_config, max_model_len)
    if spec_config.use_eagle:
        if loaded is None:
            raise ValueError(
                f"speculative method {spec_config.method!r} needs the target model (build_proposer(..., loaded=...))"
            )
        from vlserve.spec_decode.eagle import build_eagle_proposer

        return build_eagle_proposer(spec_config, loaded, max_model_len, block_size)
    raise ValueError(f"unknown speculative method {spec_config.method!r}")
