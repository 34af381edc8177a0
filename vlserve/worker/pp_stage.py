"""One pipeline stage's model runner: the step as `ModelRunner` plans it, with the stream handed between stages.

Every stage runs `execute_model` on the same SchedulerOutput and so builds the same batch (the same token rows,
positions and attention metadata; each its own layers' KV). Stage k > 0 receives `(hidden, residual)` `[T, H]`
from stage k - 1 instead of embedding token ids; stage k < last sends its own on and samples nothing. The last stage
applies the final norm, the LM head and the sampler; the other stages sample nothing and do not wait for it: they
learn the tokens sampled since a request's last step from the next SchedulerOutput that schedules it
(`CachedRequestData.new_token_ids`), so stage 0 can start the next batch while the last stage still runs this one
(the engine's batch queue). The last stage's output (with logprobs) is the step's result.

Multimodal models: only the first stage holds the encoder parts, so only it encodes the released items, caches
their embeddings and writes them over the placeholder rows; later stages start from the stream they receive. Every
stage keeps the requests' mm features (M-RoPE positions are computed from them on every stage).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from vlserve.core.sched_output import SchedulerOutput
from vlserve.distributed.pipeline import (IntermediateTensors, is_first_stage, is_last_stage, recv_intermediate,
                                          send_intermediate)
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.worker.model_runner import ModelRunner
from vlserve.worker.request_state import CachedRequestState
from vlserve.worker.sample_step import StepSamples

logger = logging.getLogger(__name__)


class PipelineStageRunner(ModelRunner):
    """A ModelRunner over one pipeline stage's layers (eager: no torch.compile or CUDA graphs yet)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first_stage, self.last_stage = is_first_stage(), is_last_stage()
        self.hidden_size = self.text_config.hidden_size
        logger.info("pipeline stage: decoder layers [%d, %d)%s%s, eager", self.kv_layers.start, self.kv_layers.stop,
                    " + embeddings" if self.first_stage else "", " + final norm, LM head, sampler" if self.last_stage
                    else "")

    def _run_encoders(self, so: SchedulerOutput) -> tuple[float, int]:
        """The first stage encodes; the others hold no encoder (and their `encoder_outputs` stay empty)."""
        return super()._run_encoders(so) if self.first_stage else (0.0, 0)

    def _merge_mm_embeddings(self, input_ids, states, starts, q_lens, cu,
                             skip_missing: bool = False) -> torch.Tensor | None:
        """`inputs_embeds [T, H]` on the first stage (see ModelRunner); None on the others, which receive hidden
        states instead of embedding tokens."""
        if not self.first_stage:
            return None
        return super()._merge_mm_embeddings(input_ids, states, starts, q_lens, cu, skip_missing)

    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                   inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        """Receive the stream (stage > 0), run this stage's layers, send it on (stage < last). Returns the normed
        hidden `[T, H]` on the last stage, this stage's hidden (unused) on the others."""
        T = input_ids.shape[0]
        received = None if self.first_stage else recv_intermediate(T, self.hidden_size, self.dtype, self.device)
        out = self.model(input_ids, positions, self.kv_caches, md, inputs_embeds=inputs_embeds,
                         intermediate=received)
        if isinstance(out, IntermediateTensors):
            send_intermediate(out)
            return out.hidden
        return out

    def _sample_step(self, hidden: torch.Tensor, states: list[CachedRequestState], ends: np.ndarray,
                     drafts: list[list[int]], so: SchedulerOutput) -> StepSamples:
        """The last stage samples; the others return no tokens (the scheduler sends them the tokens later)."""
        if self.last_stage:
            return super()._sample_step(hidden, states, ends, drafts, so)
        return StepSamples()
