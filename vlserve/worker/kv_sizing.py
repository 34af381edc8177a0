"""How many KV blocks fit: an explicit count, an explicit byte budget, or a profile of a dummy forward (numbers only:
the runner runs the profile and allocates every cache)."""
from __future__ import annotations

import logging
import time

import torch

from vlserve.core.kv_cache_manager import cdiv

logger = logging.getLogger(__name__)


def _available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (falls back to 4 GiB where that file does not exist)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


CPU_PROFILE_MAX_TOKENS = 1024  # a CPU profile runs at most this many tokens and scales its peak up


def profile_peak_bytes(runner, num_tokens: int) -> int:
    """Peak extra memory of a `num_tokens` forward. On a GPU that forward is run. On a CPU a prefill of
    thousands of tokens takes a minute (attention grows with the square of its length), while its memory grows
    with the length alone (no [T, T] scores are held), so at most CPU_PROFILE_MAX_TOKENS run and the peak is
    scaled by num_tokens / tokens run, an upper bound."""
    run = num_tokens if runner.device.type == "cuda" else min(num_tokens, CPU_PROFILE_MAX_TOKENS)
    start = time.perf_counter()
    peak = runner.profile_peak_activation_bytes(run)
    scaled = peak if run == num_tokens else cdiv(peak * num_tokens, run)
    logger.info("profile: a %d-token forward took %.1f s, peak %.1f MiB%s", run, time.perf_counter() - start,
                peak / 2**20, "" if run == num_tokens else f", {scaled / 2**20:.1f} MiB scaled to {num_tokens} tokens")
    return scaled


def determine_num_kv_blocks(runner, *, num_kv_blocks: int | None, kv_cache_memory_bytes: int | None,
                            memory_fraction: float, max_num_batched_tokens: int, max_model_len: int,
                            max_num_seqs: int) -> int:
    """num_kv_blocks if given; else kv_cache_memory_bytes / bytes per block; else profile: a fraction of the free
    memory minus the dummy forward's peak, capped at what max_num_seqs full-length sequences could ever use."""
    per_block = runner.bytes_per_block()
    if num_kv_blocks is not None:
        return num_kv_blocks
    if kv_cache_memory_bytes is not None:
        n = kv_cache_memory_bytes // per_block
        if n < 1:
            raise ValueError(f"kv_cache_memory_bytes={kv_cache_memory_bytes} is less than one KV block "
                             f"({per_block} bytes)")
        return int(n)
    peak = profile_peak_bytes(runner, min(max_num_batched_tokens, max_model_len))
    if runner.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info()
    else:
        free = _available_host_bytes()
    budget = int(free * memory_fraction) - peak
    cap = max_num_seqs * cdiv(max_model_len, runner.block_size) + 1
    n = min(max(budget // per_block, 0), cap)
    if n < cdiv(max_model_len, runner.block_size):
        raise ValueError(f"only {n} KV blocks fit in memory ({budget} bytes); a max_model_len sequence needs "
                         f"{cdiv(max_model_len, runner.block_size)}: lower max_model_len or free memory")
    logger.info("KV cache: %d blocks of %d tokens (%.1f MiB): %.0f%% of %.1f MiB free, less the profiled peak of "
                "%.1f MiB, at most %d sequences of %d tokens", n, runner.block_size, n * per_block / 2**20,
                100 * memory_fraction, free / 2**20, peak / 2**20, max_num_seqs, max_model_len)
    return int(n)
