"""The KV pool's size: --num-kv-blocks, else --kv-cache-memory-bytes, else (CPU) $VLSERVE_CPU_KVCACHE_SPACE GiB, else
the default: enough for max_num_seqs x max_model_len tokens at the model's KV bytes per token, capped by the memory
budget (a fraction of free memory less a profiled forward). One start-up line says what was reserved and why."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from vlserve.worker import kv_sizing
from vlserve.worker.kv_sizing import CPU_KVCACHE_SPACE_ENV, default_num_kv_blocks, determine_num_kv_blocks

DEMO_BYTES_PER_TOKEN = 4 * 2 * 2 * 48 * 4  # vlserve-demo: 4 layers x (K, V) x 2 KV heads x head dim 48 x fp32
MiB = 2**20


class _Runner:
    """What determine_num_kv_blocks asks of a ModelRunner."""

    def __init__(
        self,
        bytes_per_token: int = DEMO_BYTES_PER_TOKEN,
        block_size: int = 16,
        device: str = "cpu",
        peak: int = 10 * MiB,
    ):
        self.block_size = block_size
        self.device = torch.device("cpu") if device == "cpu" else SimpleNamespace(type=device)
        self._per_block = bytes_per_token * block_size
        self._peak = peak
        self.profiled: list[int] = []

    def bytes_per_block(self) -> int:
        return self._per_block

    def profile_peak_activation_bytes(self, num_tokens: int) -> int:
        self.profiled.append(num_tokens)
        return self._peak


def size(
    runner, *, num_kv_blocks=None, kv_cache_memory_bytes=None, max_num_seqs=128, max_model_len=4096, fraction=0.25
) -> int:
    return determine_num_kv_blocks(
        runner,
        num_kv_blocks=num_kv_blocks,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        memory_fraction=fraction,
        max_num_batched_tokens=4096,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
    )


@pytest.fixture(autouse=True)
def _host(monkeypatch):
    monkeypatch.delenv(CPU_KVCACHE_SPACE_ENV, raising=False)
    monkeypatch.setattr(kv_sizing, "_available_host_bytes", lambda: 16 << 30)


def test_default_rule_is_max_num_seqs_times_max_model_len_capped_by_the_budget():
    per_block = DEMO_BYTES_PER_TOKEN * 16
    n, why = default_num_kv_blocks(
        bytes_per_block=per_block, block_size=16, budget_bytes=4 << 30, max_num_seqs=8, max_model_len=1000
    )
    assert n == 8 * 63 + 1 and "8 x 1000 tokens" in why  # 1000 tokens take 63 blocks of 16; one null block
    n, why = default_num_kv_blocks(
        bytes_per_block=per_block, block_size=16, budget_bytes=100 * per_block + 5, max_num_seqs=8, max_model_len=1000
    )
    assert n == 100 and "capped by the memory budget" in why
    assert (
        default_num_kv_blocks(
            bytes_per_block=per_block, block_size=16, budget_bytes=-1, max_num_seqs=8, max_model_len=1000
        )[0]
        == 0
    )


def test_default_on_cpu_sizes_from_the_model_and_logs_why(caplog):
    runner = _Runner()
    with caplog.at_level(logging.INFO, logger="vlserve.worker.kv_sizing"):
        n = size(runner, max_num_seqs=4, max_model_len=512)
    assert n == 4 * 32 + 1 and runner.profiled == [512]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert len(lines) == 1
    line = lines[0]
    assert f"{n * 16 * DEMO_BYTES_PER_TOKEN / MiB:.1f} MiB reserved" in line and f"{n} blocks" in line
    assert f"{DEMO_BYTES_PER_TOKEN} bytes/token" in line and "4 x 512 tokens" in line
    assert "25% of 16384 MiB free" in line and CPU_KVCACHE_SPACE_ENV in line


def test_default_is_capped_by_the_memory_budget():
    runner = _Runner(peak=0)
    n = size(runner, max_num_seqs=128, max_model_len=4096, fraction=(64 * MiB) / (16 << 30))  # budget: 64 MiB
    assert n == 64 * MiB // runner.bytes_per_block()


def test_too_little_memory_for_one_sequence_is_an_error():
    with pytest.raises(ValueError, match="lower max_model_len"):
        size(_Runner(peak=0), max_model_len=4096, fraction=MiB / (16 << 30))


def test_user_sizes_win_in_order(monkeypatch, caplog):
    runner = _Runner()
    per_block = runner.bytes_per_block()
    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, "0.5")
    with caplog.at_level(logging.INFO, logger="vlserve.worker.kv_sizing"):
        assert size(runner) == (1 << 29) // per_block
    assert f"${CPU_KVCACHE_SPACE_ENV}=0.5 GiB" in caplog.records[-1].getMessage()
    assert size(runner, kv_cache_memory_bytes=100 * per_block) == 100  # the flag wins over the variable
    assert size(runner, num_kv_blocks=7, kv_cache_memory_bytes=100 * per_block) == 7
    assert runner.profiled == []  # a size the user chose needs no profile run


def test_cpu_kvcache_space_only_on_cpu(monkeypatch):
    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, "0.5")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (8 << 30, 16 << 30))
    runner = _Runner(device="cuda")
    assert size(runner, max_num_seqs=2, max_model_len=160) == 2 * 10 + 1 and runner.profiled == [160]


@pytest.mark.parametrize("value", ["lots", "0", "-1", "inf"])
def test_bad_cpu_kvcache_space_is_refused(monkeypatch, value):
    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, value)
    with pytest.raises(ValueError, match=CPU_KVCACHE_SPACE_ENV):
        size(_Runner())


def test_demo_model_default():
    """vlserve-demo at the server's defaults (128 sequences of 4096 tokens, 3072 bytes a token): 1.5 GiB when the
    budget allows it."""
    n = size(_Runner())
    assert n == 128 * 256 + 1 and n * 16 * DEMO_BYTES_PER_TOKEN == 1536 * MiB + 16 * DEMO_BYTES_PER_TOKEN
