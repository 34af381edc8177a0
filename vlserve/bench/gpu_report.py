"""CUDA-only figures for the throughput bench: GPU-busy fraction (profiler kernel time / wall) and the roofline.

The roofline is the time one step needs just to stream the weights and the KV it reads at the device's peak memory
bandwidth; the ratio to the measured ms/step says how far the engine is from the memory limit.
"""

from __future__ import annotations

import time

import torch

# Peak HBM bandwidth in bytes/s by device-name fragment (vendor figures); override with VLSERVE_PEAK_BW_GBS.
PEAK_BANDWIDTH = {
    "H200": 4.8e12,
    "H100 NVL": 3.9e12,
    "H100": 3.35e12,
    "A100": 2.0e12,
    "L40S": 0.864e12,
    "A10": 0.6e12,
    "L4": 0.3e12,
}


def peak_bandwidth(name: str) -> float | None:
    import os

    if os.environ.get("VLSERVE_PEAK_BW_GBS"):
        return float(os.environ["VLSERVE_PEAK_BW_GBS"]) * 1e9
    for key, bw in PEAK_BANDWIDTH.items():
        if key in name:
            return bw
    return None


def gpu_busy_fraction(run) -> tuple[float, float]:
    """(kernel seconds, wall seconds) of run() under the torch profiler (overlapping kernels counted once each)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kernel_us = sum(e.device_time for e in prof.events() if e.device_type.name == "CUDA")
    return kernel_us / 1e6, wall


def print_gpu_report(llm, prompts, params, seconds: float, steps: int) -> None:
    """GPU busy over one more timed run of the same batch, and the per-step bandwidth roofline."""
    kernel_s, wall = gpu_busy_fraction(lambda: llm.generate(prompts, params, use_tqdm=False))
    print(f"GPU busy: {100 * kernel_s / wall:.1f}% (kernel {kernel_s:.3f} s / wall {wall:.3f} s, profiled run)")
    runner = llm.engine.runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_per_token = runner.bytes_per_block() / runner.block_size  # all layers, K and V
    # Average context per step: prompt + half the output, for every running sequence.
    avg_ctx = sum(len(p) + sp.max_tokens / 2 for p, sp in zip(prompts, params)) / max(len(prompts), 1)
    batch = min(len(prompts), runner_batch(llm))
    step_bytes = weight_bytes + batch * avg_ctx * kv_per_token
    bw = peak_bandwidth(torch.cuda.get_device_name())
    if bw is None:
        print(f"roofline: unknown peak bandwidth for {torch.cuda.get_device_name()} (set VLSERVE_PEAK_BW_GBS)")
        return
    floor_ms = 1000 * step_bytes / bw
    print(
        f"roofline: {step_bytes / 1e9:.2f} GB per decode step (weights {weight_bytes / 1e9:.2f} GB + KV) at "
        f"{bw / 1e12:.2f} TB/s = {floor_ms:.3f} ms/step; measured {1000 * seconds / max(steps, 1):.3f} ms/step "
        f"({floor_ms / (1000 * seconds / max(steps, 1)) * 100:.1f}% of the limit)"
    )


def runner_batch(llm) -> int:
    return llm.engine.scheduler_config.max_num_seqs
