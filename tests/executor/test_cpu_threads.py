"""How engine processes share a machine's cores: one core is kept for the API process only on machines big enough
to spare it."""

from __future__ import annotations

import pytest

from vlserve.executor.worker import FRONTEND_CORE_FROM, cpu_threads_per_process


@pytest.mark.parametrize(
    "cores,world,expected",
    [
        (1, 1, 1),
        (2, 1, 2),
        (2, 2, 1),
        (3, 1, 3),  # small machines: every core works
        (4, 1, 3),
        (8, 1, 7),
        (8, 2, 3),
        (16, 4, 3),  # big ones keep one for the API process
        (4, 8, 1),  # never below one thread
    ],
)
def test_threads_per_engine_process(cores, world, expected):
    assert cpu_threads_per_process(cores, world) == expected


def test_the_spare_core_starts_at_the_documented_size():
    assert cpu_threads_per_process(FRONTEND_CORE_FROM - 1, 1) == FRONTEND_CORE_FROM - 1
    assert cpu_threads_per_process(FRONTEND_CORE_FROM, 1) == FRONTEND_CORE_FROM - 1
