"""The memory profile's token count: a CPU runs at most CPU_PROFILE_MAX_TOKENS and scales the peak up; a GPU runs
the whole count."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vlserve.worker.kv_sizing import CPU_PROFILE_MAX_TOKENS, profile_peak_bytes


class _Runner:
    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.ran: list[int] = []

    def profile_peak_activation_bytes(self, num_tokens: int) -> int:
        self.ran.append(num_tokens)
        return 1000 * num_tokens + 7


def test_cpu_profile_runs_a_bounded_prefill_and_scales_its_peak():
    runner = _Runner("cpu")
    tokens = 4 * CPU_PROFILE_MAX_TOKENS + 3
    peak = profile_peak_bytes(runner, tokens)
    assert runner.ran == [CPU_PROFILE_MAX_TOKENS]
    assert peak >= 1000 * tokens  # the scaled peak bounds a linear one from above
    assert peak == -(-(1000 * CPU_PROFILE_MAX_TOKENS + 7) * tokens // CPU_PROFILE_MAX_TOKENS)


@pytest.mark.parametrize("tokens", [1, CPU_PROFILE_MAX_TOKENS])
def test_cpu_profile_of_few_tokens_runs_them_all(tokens):
    runner = _Runner("cpu")
    assert profile_peak_bytes(runner, tokens) == 1000 * tokens + 7
    assert runner.ran == [tokens]


def test_gpu_profile_runs_every_token():
    runner = _Runner("cpu")
    runner.device = SimpleNamespace(type="cuda")
    assert profile_peak_bytes(runner, 3 * CPU_PROFILE_MAX_TOKENS) == 3000 * CPU_PROFILE_MAX_TOKENS + 7
    assert runner.ran == [3 * CPU_PROFILE_MAX_TOKENS]
