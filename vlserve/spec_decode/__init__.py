"""Speculative decoding: config and the n-gram and EAGLE draft proposers (the runner verifies their drafts with
`vlserve.worker.rejection_sampler`)."""

from vlserve.spec_decode.config import SpeculativeConfig
from vlserve.spec_decode.eagle import EagleProposer
from vlserve.spec_decode.ngram_proposer import NgramProposer
from vlserve.spec_decode.proposers import build_proposer

__all__ = ["SpeculativeConfig", "NgramProposer", "EagleProposer", "build_proposer"]
