"""How many KV blocks fit: an explicit count, an explicit byte budget, or a profile of a dummy forward (numbers only:
the runner runs the profile and allocates every cache)."""

from __future__ import annotations

import logging
import os
import time

import torch

from vlserve.core.kv_cache_manager import cdiv

logger = logging.getLogger(__name__)


def _drop_no_cuda_runtime(record: logging.LogRecord) -> bool:
    """torch.utils.cpp_extension logs "No CUDA runtime is found, using CUDA_HOME=..." when it is first imported on a
    machine that has a CUDA toolkit but no usable GPU (only then); inductor imports it when it builds vlserve's C++ CPU
    kernels, at model load. A CPU server builds no CUDA extension, so that line is dropped."""
    return not record.getMessage().startswith("No CUDA runtime is found")


# Installed here because every process that builds a model's kernels imports this module first (the engine, each
# tensor-parallel rank, in-thread and offline engines: vlserve.executor.worker imports it); addFilter is idempotent.
logging.getLogger("torch.utils.cpp_extension").addFilter(_drop_no_cuda_runtime)


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
    logger.debug(
        "profile: a %d-token forward took %.1f s, peak %.1f MiB%s",
        run,
        time.perf_counter() - start,
        peak / 2**20,
        "" if run == num_tokens else f", {scaled / 2**20:.1f} MiB scaled to {num_tokens} tokens",
    )
    return scaled


CPU_KVCACHE_SPACE_ENV = "VLSERVE_CPU_KVCACHE_SPACE"  # GiB of KV cache per rank on CPU (vLLM's VLLM_CPU_KVCACHE_SPACE)


def cpu_kvcache_space_bytes() -> int | None:
    """$VLSERVE_CPU_KVCACHE_SPACE in bytes (it is given in GiB, fractions allowed), or None when unset or empty."""
    raw = os.environ.get(CPU_KVCACHE_SPACE_ENV, "").strip()
    if not raw:
        return None
    try:
        gib = float(raw)
    except ValueError:
        raise ValueError(f"${CPU_KVCACHE_SPACE_ENV}={raw[:40]!r} is not a number of GiB") from None
    if not gib > 0 or gib == float("inf"):
        raise ValueError(f"${CPU_KVCACHE_SPACE_ENV} must be a positive number of GiB, got {raw[:40]!r}")
    return int(gib * 2**30)


def default_num_kv_blocks(
    *, bytes_per_block: int, block_size: int, budget_bytes: int, max_num_seqs: int, max_model_len: int
) -> tuple[int, str]:
    """The KV pool when the user sized none: enough blocks for max_num_seqs sequences of max_model_len tokens (plus
    the null block), capped by what the memory budget holds; and why, for the start-up log."""
    demand = max_num_seqs * cdiv(max_model_len, block_size) + 1
    fit = max(budget_bytes, 0) // bytes_per_block
    if demand <= fit:
        return demand, (
            f"max_num_seqs x max_model_len = {max_num_seqs} x {max_model_len} tokens, within the memory budget"
        )
    return int(fit), (
        f"capped by the memory budget: max_num_seqs x max_model_len = {max_num_seqs} x {max_model_len} "
        f"tokens would take {demand * bytes_per_block / 2**20:.1f} MiB"
    )


def _bytes_budget(per_block: int, budget: int, what: str) -> int:
    n = budget // per_block
    if n < 1:
        raise ValueError(f"{what}={budget} is less than one KV block ({per_block} bytes)")
    return int(n)


def determine_num_kv_blocks(
    runner,
    *,
    num_kv_blocks: int | None,
    kv_cache_memory_bytes: int | None,
    memory_fraction: float,
    max_num_batched_tokens: int,
    max_model_len: int,
    max_num_seqs: int,
) -> int:
    """num_kv_blocks if given; else kv_cache_memory_bytes / bytes per block (the runner's: its KV cache dtype's
    element size, so an FP8 cache holds twice the blocks of a bf16 one in the same bytes); else, on CPU,
    $VLSERVE_CPU_KVCACHE_SPACE GiB; else `default_num_kv_blocks`: max_num_seqs x max_model_len tokens' worth, capped
    by the memory budget (a fraction of the free memory minus a dummy forward's profiled peak). Logs one line: what
    was reserved and why (on CPU the pool's pages become resident only as blocks are written: `kv_memory`)."""
    per_block = runner.bytes_per_block()
    cpu = runner.device.type != "cuda"
    per_token = per_block / runner.block_size
    if num_kv_blocks is not None:
        n, why = num_kv_blocks, "--num-kv-blocks"
    elif kv_cache_memory_bytes is not None:
        n, why = _bytes_budget(per_block, kv_cache_memory_bytes, "kv_cache_memory_bytes"), "--kv-cache-memory-bytes"
    elif cpu and (space := cpu_kvcache_space_bytes()) is not None:
        n = _bytes_budget(per_block, space, f"${CPU_KVCACHE_SPACE_ENV}")
        why = f"${CPU_KVCACHE_SPACE_ENV}={os.environ[CPU_KVCACHE_SPACE_ENV].strip()} GiB"
    else:
        peak = profile_peak_bytes(runner, min(max_num_batched_tokens, max_model_len))
        free = _available_host_bytes() if cpu else torch.cuda.mem_get_info()[0]
        budget = int(free * memory_fraction) - peak
        n, why = default_num_kv_blocks(
            bytes_per_block=per_block,
            block_size=runner.block_size,
            budget_bytes=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
        )
        why += (
            f" ({budget / 2**20:.0f} MiB: {100 * memory_fraction:.0f}% of {free / 2**20:.0f} MiB free less a "
            f"{peak / 2**20:.0f} MiB forward); --kv-cache-memory-bytes"
            + (f" or ${CPU_KVCACHE_SPACE_ENV} (GiB)" if cpu else "")
            + " sets it"
        )
        if n < cdiv(max_model_len, runner.block_size):
            raise ValueError(
                f"only {n} KV blocks fit in memory ({budget} bytes); a max_model_len sequence needs "
                f"{cdiv(max_model_len, runner.block_size)}: lower max_model_len or free memory"
            )
    kv_dtype = str(getattr(runner, "kv_cache_dtype", "")).replace("torch.", "")
    logger.info(
        "KV cache: %.1f MiB reserved%s, %d blocks of %d tokens = %d tokens at %d bytes/token%s (%s)",
        n * per_block / 2**20,
        " (resident as blocks are first used)" if cpu else "",
        n,
        runner.block_size,
        n * runner.block_size,
        round(per_token),
        f" in {kv_dtype}" if kv_dtype else "",
        why,
    )
    return int(n)
