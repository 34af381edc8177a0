"""The FP8 KV cache (`kv_cache_dtype="fp8"`): which torch dtype a cache takes, and the torch quantize / dequantize
rule that every path (torch, Triton, the C++ CPU kernel) follows.

A cache of float8_e4m3fn holds `clamp(x / scale, -448, 448)` rounded to the nearest e4m3 value (ties to even), with
one float scale per layer for K and one for V (`k_scale`, `v_scale`: from the checkpoint, else 1.0). Reading
multiplies by the scale in float32 before any dot product. Caches of any other dtype ignore the scales.
"""

from __future__ import annotations

import torch

from vlserve.config import KV_CACHE_DTYPES

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def kv_cache_torch_dtype(
    kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device | None = None
) -> torch.dtype:
    """The KV cache tensors' dtype: the model's for "auto", float8_e4m3fn for "fp8" / "fp8_e4m3". ValueError for
    other names, and for FP8 on a GPU below compute capability 8.9 (Triton has no e4m3 conversions there)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in ("fp8", "fp8_e4m3"):
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")
    if device is not None and torch.device(device).type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} needs a GPU of compute capability 8.9 or newer "
                f"(Ada, Hopper) for the Triton kernels' float8_e4m3fn; this one is "
                f"{capability[0]}.{capability[1]}"
            )
    return FP8_KV_DTYPE


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether `cache` is an FP8 KV cache (its reads and writes apply the scales)."""
    return cache.dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """`x` (any float dtype) -> float8_e4m3fn of `clamp(x / scale, +-448)`, computed in float32."""
    # x: [..., D] -> same shape, float8_e4m3fn
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn `x` -> `x * scale` computed in float32, then in `dtype`."""
    # x: [..., D] float8_e4m3fn -> same shape in dtype (a new tensor)
    return (x.float() * scale).to(dtype)


def kv_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of an FP8 tensor, for the copies and fills torch does not implement for float8 on CPU."""
    return t.view(torch.uint8)
