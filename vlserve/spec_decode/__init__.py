"""Speculative decoding: config, n-gram and EAGLE drafting, and the rejection sampler that verifies drafts exactly."""
from vlserve.spec_decode.config import SpeculativeConfig
from vlserve.spec_decode.eagle import EagleProposer, EagleStepInputs
from vlserve.spec_decode.ngram_proposer import NgramProposer
from vlserve.spec_decode.proposers import build_proposer
from vlserve.spec_decode.rejection_sampler import (PLACEHOLDER_TOKEN_ID, RejectionSampler, RejectionSamplerOutput,
                                                   build_spec_sampling_metadata, compute_target_probs,
                                                   rejection_sample_ref)

__all__ = ["SpeculativeConfig", "NgramProposer", "EagleProposer", "EagleStepInputs", "build_proposer",
           "RejectionSampler", "RejectionSamplerOutput", "rejection_sample_ref", "build_spec_sampling_metadata", "compute_target_probs", "PLACEHOLDER_TOKEN_ID"]
