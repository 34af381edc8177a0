"""Host-to-device copies that never wait for the device.

A plain `torch.tensor(data, device="cuda")` or `cpu_tensor.to("cuda")` copies from pageable memory and then waits for
the stream to drain. In a step's preparation that wait is harmless when the device is idle, but under async
scheduling the device is still running the step before, so each such copy would hold the host until that step is
done and nothing would overlap. These helpers stage through pinned memory (torch's caching host allocator, which
keeps the block until the copy has run) and copy with `non_blocking=True`; off CUDA they are plain conversions.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` (a host tensor) on `device`, without waiting for the device's queued work on CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    if t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def tensor_to_device(data: Any, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(data, dtype=dtype)` on `device`, built on the host and copied as `to_device` does."""
    return to_device(torch.tensor(data, dtype=dtype), device)
