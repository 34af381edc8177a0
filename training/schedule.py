"""The demo trainer's shared pieces for both stages: the LR schedule (warmup + cosine, optionally run on the clock)
and background rendering of batches."""

from __future__ import annotations

import math


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak`, then cosine decay to 5% of it at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def schedule_step(step: int, steps: int, elapsed: float, minutes: float | None) -> int:
    """The step the LR schedule is at: `step`, or further along when the wall-clock cap will stop the run first, so a
    capped run still ends on a decayed LR. The clock runs 5% of the steps behind (at the cap the schedule is at 95%,
    within 1% of the floor LR), so that a slow start (the first batches' rendering) never moves a run that finishes
    its steps in time: that run's LR follows its steps alone, and the same arguments give the same run."""
    if minutes is None:
        return step
    return max(step, min(steps, int(steps * elapsed / (60 * minutes)) - steps // 20))


def in_background(stream, workers: int):
    """Iterator over the (endless, picklable) iterable `stream`; with workers=1 its items are produced in one
    DataLoader worker process, in the same order."""
    import torch

    if workers == 0:
        return iter(stream)

    class _Iterable(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(stream)

    return iter(torch.utils.data.DataLoader(_Iterable(), batch_size=None, num_workers=1, prefetch_factor=4))
