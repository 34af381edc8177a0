"""The per-step encoder budget sized in time (pure Python, no torch): one step's encoder work should cost about as
much as one decode step or a floor of wall time (`min_step_seconds`, the engine's `encoder_step_ms`), whichever is
longer, so a burst of images delays running streams by about that much a step, not by the whole burst.

The runner reports per step the wall seconds its encoder calls took, the embeddings they produced and the step's
own seconds (`ModelRunnerOutput`). Two exponential moving averages follow them: seconds per embedding (over steps
that encoded) and the seconds of a decode step (a step that prefilled nothing: its seconds less its encoder
seconds, so the steps of a burst, which decode and encode at once, keep both measured). The budget is decode step
seconds (or the floor, if longer) / seconds per embedding, at least 1; until seconds per embedding and one of the
two have been measured it is 1 (one item, or one stage of a split item, per step: the scheduler always admits a
step's first item). A budget the user set is used as is.

The budget also gives the plan a slice cap (`slice_cap`: embeddings of about `max_slice_seconds`, 1 s, at the measured
rate): an item over the budget that a step encodes alone takes at least a third of its stages within that cap, so a
float32 896x896 image (~1.4 s of tower here) is encoded in three steps rather than eight.

It gives a packing budget too (`pack`: one decode step's worth of embeddings, at least 1, at most the budget): a
step's first item may take the whole budget, but further items join it only while its encoder work stays within
one decode step. A burst of small images then gets its first tokens one step after another instead of all at the
end of one step that encodes them all: on the 2-core AMX machine (bf16, concurrency 8, 48 requests, vlserve
alone, an A/B of alternating runs) 224x224 images went from 173-205 to 119-137 ms TTFT p50 and a 4-frame video
from 379-435 to 268-270 ms; request rate level for the images, 2-7% lower for the video (docs/benchmarks.md).
Items longer than a decode step but within the budget (448x448 and up here) ran one a step before and still do.

Why a floor: a step that encodes a slice of an image also runs the decode rows and the LM head of every running
request, and images cut into slices of one decode step each cannot share a tower call; on a 2-core CPU, 16 448x448
requests to a small Qwen2-VL took 2.54 s offline at one decode step (~10 ms) of encoder work a step, 1.96 s at one
image a step (~90 ms), 1.66 s at four (docs/benchmarks.md).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class EncoderBudget:
    """Embeddings to encode per step: `fixed` when the user set it, else adapted from measured timings."""

    def __init__(
        self,
        fixed: int | None = None,
        smoothing: float = 0.25,
        min_step_seconds: float = 0.0,
        max_slice_seconds: float = 1.0,
    ):
        if fixed is not None and fixed < 1:
            raise ValueError(f"the encoder budget must be >= 1 embedding, got {fixed}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if not min_step_seconds >= 0.0:
            raise ValueError(f"the encoder step floor must be >= 0 seconds, got {min_step_seconds}")
        self.fixed = fixed
        self.smoothing = smoothing  # weight of the newest sample in each moving average
        self.min_step_seconds = min_step_seconds  # encoder seconds a step may take even when decode steps are shorter
        self.seconds_per_embed: float | None = None  # moving average over steps that encoded
        self.decode_step_seconds: float | None = None  # moving average over decode steps that encoded nothing
        self.budget = fixed if fixed is not None else 1
        self.pack = self.budget  # embeddings a step may reach with items after its first (<= budget)
        # a slice of an item over the budget may take up to this many seconds of tower work (`slice_cap`), so a large
        # item needs few steps (each carries a decode step) while running streams still get a token a second or so
        self.max_slice_seconds = max_slice_seconds
        self.slice_cap = 0  # embeddings of max_slice_seconds at the measured rate (0: unmeasured, or a fixed budget)

    def observe(
        self, encoder_seconds: float, num_encoded_embeds: int, step_seconds: float, is_decode: bool = True
    ) -> int:
        """Fold one step's timings in; returns the budget for the steps planned from now on. `is_decode`: the step
        computed one token (plus its drafts) per request; only such a step times a decode step, by its seconds
        less its encoder seconds (a text prefill would make the budget as long as that prefill)."""
        if self.fixed is not None:
            return self.budget
        if num_encoded_embeds > 0:
            self.seconds_per_embed = self._average(self.seconds_per_embed, encoder_seconds / num_encoded_embeds)
        if is_decode and step_seconds - encoder_seconds > 0.0:
            self.decode_step_seconds = self._average(self.decode_step_seconds, step_seconds - encoder_seconds)
        if self.seconds_per_embed is not None:
            self.slice_cap = int(self.max_slice_seconds / max(self.seconds_per_embed, 1e-12))
        step = max(self.decode_step_seconds or 0.0, self.min_step_seconds)
        if self.seconds_per_embed is None or step <= 0.0:
            return self.budget
        budget = max(1, round(step / max(self.seconds_per_embed, 1e-12)))
        self.pack = min(budget, max(1, round((self.decode_step_seconds or 0.0) / max(self.seconds_per_embed, 1e-12))))
        old = self.budget
        if budget >= 2 * old or 2 * budget <= old:
            logger.debug(
                "encoder budget %d -> %d embeddings per step (%.2f ms a step, %.3f ms per embedding)",
                old,
                budget,
                1e3 * step,
                1e3 * self.seconds_per_embed,
            )
        self.budget = budget
        return budget

    def _average(self, avg: float | None, sample: float) -> float:
        return sample if avg is None else avg + self.smoothing * (sample - avg)
