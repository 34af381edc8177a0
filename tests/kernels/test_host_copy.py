"""`kernels.host_copy`: host tensors reach the device through pinned memory without waiting for the device's queued
work (a plain copy from pageable memory drains the stream first, which would stall async scheduling)."""

import pytest
import torch

from vlserve.kernels.host_copy import tensor_to_device, to_device


def test_on_cpu_the_helpers_are_plain_conversions():
    t = torch.arange(5)
    assert to_device(t, "cpu") is t
    out = tensor_to_device([1.5, 2.5], torch.float32, torch.device("cpu"))
    assert out.dtype == torch.float32 and out.tolist() == [1.5, 2.5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_copy_does_not_synchronize():
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call below raises
    try:
        for _ in range(4):
            busy = busy @ busy  # queued work the copies must not wait for
        got = tensor_to_device(list(range(100)), torch.int64, "cuda")
        pinned_src = to_device(torch.arange(7), "cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert got.device.type == "cuda" and got.tolist() == list(range(100))
    assert pinned_src.tolist() == list(range(7))
    with pytest.raises(RuntimeError):  # what the helpers avoid: a blocking copy from pageable memory
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch.tensor([1, 2, 3], device="cuda")
        finally:
            torch.cuda.set_sync_debug_mode(0)
