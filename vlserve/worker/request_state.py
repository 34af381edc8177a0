"""The model runner's per-request state: token ids, block table, generator, M-RoPE offsets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vlserve.multimodal.inputs import MultiModalFeature
from vlserve.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the runner remembers about a request between steps (rebuilt from scratch after preemption)."""

    req_id: str
    token_ids: list[int]  # prompt + outputs sampled so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]  # KV cache group 0's (the full-attention group; the draft reads it)
    num_computed_tokens: int
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None  # [3, num_prompt_tokens] int64, M-RoPE models only
    mrope_delta: int = 0  # text position after the prompt = index + mrope_delta
    unplaced_pruned: set[str] = field(default_factory=set)  # pruned videos whose positions are still provisional
    kept_indices: dict[str, torch.Tensor] = field(default_factory=dict)  # their kept grid indices, once placed
    key_runs: list[tuple[int, int]] = field(default_factory=list)  # bidirectional image runs (first, last), if any
    lora_request: Any = None  # its vlserve.lora.LoRARequest, or None (the base model)
    pending_sample: Any = None  # (StepHandle, index) of its latest deferred sample (deferred_samples.py), or None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
