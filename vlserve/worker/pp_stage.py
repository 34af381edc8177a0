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
import time
from dataclasses import dataclass

import numpy as np
import torch

from vlserve.core.sched_output import SchedulerOutput
from vlserve.distributed.pipeline import (
    IntermediateTensors,
    is_first_stage,
    is_last_stage,
    recv_intermediate,
    send_intermediate,
)
from vlserve.kernels.metadata import AttentionMetadata
from vlserve.worker.encoder_runs import NO_ENCODER_WORK, EncoderWork
from vlserve.worker.model_runner import ModelRunner
from vlserve.worker.request_state import CachedRequestState
from vlserve.worker.sample_step import StepSamples

logger = logging.getLogger(__name__)


@dataclass
class StageTiming:
    """Where one stage's time went since the last reset: `busy_s` inside steps, less `wait_s` blocked handing the
    stream over (receiving from the stage before, sending to the one after), over `span_s`, the wall time from the
    first step's start to the last one's end. `idle_fraction` is the pipeline bubble as this stage sees it."""

    steps: int = 0
    busy_s: float = 0.0
    wait_s: float = 0.0
    first_start: float | None = None
    last_end: float = 0.0

    @property
    def span_s(self) -> float:
        return 0.0 if self.first_start is None else self.last_end - self.first_start

    @property
    def idle_fraction(self) -> float:
        span = self.span_s
        return 0.0 if span <= 0 else 1.0 - (self.busy_s - self.wait_s) / span

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "span_s": self.span_s,
            "busy_s": self.busy_s,
            "wait_s": self.wait_s,
            "idle_fraction": self.idle_fraction,
        }


class PipelineStageRunner(ModelRunner):
    """A ModelRunner over one pipeline stage's layers (eager: no torch.compile or CUDA graphs yet)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first_stage, self.last_stage = is_first_stage(), is_last_stage()
        self.hidden_size = self.text_config.hidden_size
        self.timing = StageTiming()
        logger.info(
            "pipeline stage: decoder layers [%d, %d)%s%s, eager",
            self.kv_layers.start,
            self.kv_layers.stop,
            " + embeddings" if self.first_stage else "",
            " + final norm, LM head, sampler" if self.last_stage else "",
        )

    def execute_model(self, so: SchedulerOutput):
        """ModelRunner's step, timed into `self.timing` (steps that run no tokens are not counted)."""
        start = time.perf_counter()
        out = super().execute_model(so)
        if so.total_num_scheduled_tokens:
            end = time.perf_counter()
            t = self.timing
            t.steps += 1
            t.busy_s += end - start
            t.first_start = start if t.first_start is None else t.first_start
            t.last_end = end
        return out

    def stage_timing(self, reset: bool = False) -> dict:
        """This stage's StageTiming summary (then a fresh one when `reset`)."""
        summary = self.timing.summary()
        if reset:
            self.timing = StageTiming()
        return summary

    def _run_encoders(self, so: SchedulerOutput) -> EncoderWork:
        """The first stage encodes; the others hold no encoder (and their EncoderRunner holds nothing)."""
        return super()._run_encoders(so) if self.first_stage else NO_ENCODER_WORK

    def merge_mm_embeddings(
        self, input_ids, states, starts, q_lens, cu, skip_missing: bool = False
    ) -> torch.Tensor | None:
        """`inputs_embeds [T, H]` on the first stage (see ModelRunner); None on the others, which receive hidden
        states instead of embedding tokens."""
        if not self.first_stage:
            return None
        return super().merge_mm_embeddings(input_ids, states, starts, q_lens, cu, skip_missing)

    def _run_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        inputs_embeds: torch.Tensor | None,
    ) -> torch.Tensor:
        """Receive the stream (stage > 0), run this stage's layers, send it on (stage < last). Returns the normed
        hidden `[T, H]` on the last stage, this stage's hidden (unused) on the others."""
        T = input_ids.shape[0]
        t0 = time.perf_counter()
        received = None if self.first_stage else recv_intermediate(T, self.hidden_size, self.dtype, self.device)
        self.timing.wait_s += time.perf_counter() - t0
        out = self.model(input_ids, positions, self.kv_caches, md, inputs_embeds=inputs_embeds, intermediate=received)
        if isinstance(out, IntermediateTensors):
            t0 = time.perf_counter()
            send_intermediate(out)
            self.timing.wait_s += time.perf_counter() - t0
            return out.hidden
        return out

    def _prompt_logprobs(self, hidden, states, starts, q_lens, cu) -> dict:
        """Only the last stage has the final hidden states (and the LM head)."""
        return super()._prompt_logprobs(hidden, states, starts, q_lens, cu) if self.last_stage else {}

    def _sample_step(
        self,
        hidden: torch.Tensor,
        states: list[CachedRequestState],
        ends: np.ndarray,
        drafts: list[list[int]],
        so: SchedulerOutput,
        keep_on_device: bool = False,
    ) -> StepSamples:
        """The last stage samples; the others return no tokens (the scheduler sends them the tokens later)."""
        if self.last_stage:
            return super()._sample_step(hidden, states, ends, drafts, so, keep_on_device)
        return StepSamples()
