"""KV cache tensors that take host memory only as their blocks are used.

`torch.zeros` writes every page of a tensor when it allocates it, so a CPU server's whole KV pool was resident from
start-up (1.5 GiB for the demo model's default 128 x 4096 tokens) however little it served. On CPU each cache tensor
is instead its own private anonymous mapping: the kernel hands its pages out zero-filled on first touch, so the
contents are the same zeros (the null block, padding slots and never-written blocks read 0 as before) while the
resident size grows with the blocks actually written, up to the reservation the start-up log reports.
"""

from __future__ import annotations

import math
import mmap

import torch


def zeroed_kv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled `shape` tensor: on CPU backed by a fresh anonymous mapping (no page resident until touched),
    elsewhere `torch.zeros`."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # unmapped with the tensor
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
