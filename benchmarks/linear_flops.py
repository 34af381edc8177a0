"""FLOPs of the linear layers a piece of code runs, counted from torch.profiler's recorded shapes: the work no
engine running the same GEMMs can skip. Standard library only at import time (pooling_child.py loads it by path).
"""

from __future__ import annotations

import math

LINEAR_OPS = (
    "aten::addmm",
    "aten::mm",
    "mkldnn::_linear_pointwise",
    "vlserve::cpu_linear",
    "vlserve::cpu_linear_silu_mul",
    "vlserve::cpu_linear_silu",
)


def linear_flops(key: str, shapes: list) -> int:
    """FLOPs of one call of a LINEAR_OPS op from its recorded input shapes (2 * rows * K * N)."""
    if key == "aten::addmm":  # (bias, x [M, K], W^T [K, N])
        (m, k), n = shapes[1], shapes[2][1]
    elif key == "aten::mm":  # (x [M, K], W^T [K, N])
        (m, k), n = shapes[0], shapes[1][1]
    elif key == "mkldnn::_linear_pointwise":  # (x [..., K], W [N, K], ...)
        m, k, n = math.prod(shapes[0][:-1]), shapes[0][-1], shapes[1][0]
    else:  # vlserve::cpu_linear*: (x [..., K], packed [N / 32, ...]); the silu_mul form packs gate and up: N = 2I
        m, k, n = math.prod(shapes[0][:-1]), shapes[0][-1], shapes[1][0] * 32
    return 2 * m * k * n


def profile_linears(fn) -> dict:
    """Run fn() under torch.profiler: {"wall_s", "linear_s" (the linears' self time), "linear_gflop",
    "conv_s" (convolutions' self time), "result" (fn's)}."""
    import time

    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        result = fn()
        wall = time.perf_counter() - start
    events = prof.key_averages(group_by_input_shape=True)
    linear = [e for e in events if e.key in LINEAR_OPS]
    return {
        "wall_s": wall,
        "linear_s": sum(e.self_cpu_time_total for e in linear) / 1e6,
        "linear_gflop": sum(e.count * linear_flops(e.key, e.input_shapes) for e in linear) / 1e9,
        "conv_s": sum(e.self_cpu_time_total for e in events if "conv" in e.key) / 1e6,
        "result": result,
    }
