"""Counters the scheduler keeps; the engine turns them into `vlserve:` metrics (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    """Monotonic counters (gauges are read live from the queues and caches)."""

    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    def count_drafts(self, num_drafted: int, num_accepted: int) -> None:
        """One request's verified drafts of a step: how many were proposed, how many the target kept."""
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafted
        self.spec_num_accepted_tokens += num_accepted
