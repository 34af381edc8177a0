"""CPU-only figure for the throughput bench: the roofline of the run, compute and memory.

A decoder's work is almost all matrix products against its weights. The run's matmul FLOPs (every prompt token
and every fed-back output token through every layer's projections, plus the logits of the sampled positions and
the attention's scores and sums), divided by the GEMM rate torch reaches on this machine for the model's largest
projection in this dtype (measured here, in this process), give the shortest time any engine using those GEMMs
could take. Each step also reads every weight once and each sequence's cached K/V; those bytes at the read
bandwidth measured here give a second floor (it binds for small batches). The larger floor is the ceiling on
tokens per second that each engine's measured rate is compared with. The byte count assumes every step carries the
whole batch (one prefill step, then one decode step per further output token). When the bench repeats its prompts
(the fastest of several runs), an engine with prefix caching (vlserve and vLLM both) finds them cached; the work
then counts only each prompt's last token (its K/V still read), the least any engine must recompute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class CpuRoofline:
    """The run's matmul work and the machine's measured GEMM rate."""

    gflop: float  # matmul work of one run of the bench
    peak_gflops: float  # measured GEMM rate, GFLOP/s
    shape: tuple[int, int, int]  # (M, K, N) of the timed GEMM
    generated: int  # output tokens of one run
    gbytes: float = 0.0  # weights and KV read by one run
    bandwidth_gbs: float = float("inf")  # measured read bandwidth, GB/s
    cached: bool = False  # the prompts counted as prefix-cached but for their last token

    @property
    def compute_seconds(self) -> float:
        return self.gflop / self.peak_gflops

    @property
    def memory_seconds(self) -> float:
        return self.gbytes / self.bandwidth_gbs

    @property
    def floor_seconds(self) -> float:
        return max(self.compute_seconds, self.memory_seconds)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_seconds >= self.memory_seconds else "memory"

    @property
    def ceiling_tok_s(self) -> float:
        return self.generated / self.floor_seconds


@dataclass
class _Shapes:
    """What the counts need from a decoder's config."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    layer_weights: int  # q, k, v, o projections and the gated MLP's three, per layer

    @classmethod
    def of(cls, text_cfg) -> _Shapes:
        hidden, heads = text_cfg.hidden_size, text_cfg.num_attention_heads
        head_dim = getattr(text_cfg, "head_dim", None) or hidden // heads
        kv_heads = getattr(text_cfg, "num_key_value_heads", None) or heads
        layer_weights = (
            hidden * (heads + 2 * kv_heads) * head_dim
            + heads * head_dim * hidden
            + 3 * hidden * text_cfg.intermediate_size
        )
        return cls(hidden, text_cfg.num_hidden_layers, heads, kv_heads, head_dim, layer_weights)


def run_gflop(text_cfg, prompt_lens: list[int], output_lens: list[int], cached_lens: list[int] | None = None) -> float:
    """Matmul GFLOP of generating `output_lens` tokens after prompts of `prompt_lens` (greedy), of which the first
    `cached_lens` tokens each are in the prefix cache (none by default)."""
    m = _Shapes.of(text_cfg)
    cached = cached_lens or [0] * len(prompt_lens)
    # the last sampled token is never fed back
    tokens = sum(p - c for p, c in zip(prompt_lens, cached)) + sum(n - 1 for n in output_lens)
    weights_flop = 2 * tokens * m.layers * m.layer_weights
    logits_flop = 2 * sum(output_lens) * m.hidden * text_cfg.vocab_size  # one sampled position per output token
    # attention: a query at context position c reads c keys and c values, per head: 4 * c * head_dim FLOPs
    contexts = 0
    for p, n, c in zip(prompt_lens, output_lens, cached):
        total = p + n - 1  # query positions c .. total - 1, position i with a context of i + 1
        contexts += total * (total + 1) // 2 - c * (c + 1) // 2
    attention_flop = 4 * contexts * m.heads * m.head_dim * m.layers
    return (weights_flop + logits_flop + attention_flop) / 1e9


def run_gbytes(text_cfg, prompt_lens: list[int], output_lens: list[int], element_size: int) -> float:
    """GB read by the run's steps: all weights once a step (the batch in every step), and each decode's K/V."""
    m = _Shapes.of(text_cfg)
    weights = m.layers * m.layer_weights + m.hidden * text_cfg.vocab_size  # and the logits' projection
    steps = max(output_lens)
    kv_per_position = 2 * m.layers * m.kv_heads * m.head_dim
    # decode step i (1 <= i < n) of a sequence reads its p + i cached positions
    kv_positions = sum(sum(p + i for i in range(1, n)) for p, n in zip(prompt_lens, output_lens))
    return (steps * weights + kv_positions * kv_per_position) * element_size / 1e9


def measure_read_gbs(megabytes: int = 256, repeats: int = 5) -> float:
    """The best GB/s of summing a `megabytes` float32 buffer (far larger than the caches) over `repeats` passes."""
    x = torch.ones(megabytes * (1 << 20) // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def measure_gemm_gflops(dtype: torch.dtype, k: int, n: int, m: int = 2048, repeats: int = 10) -> float:
    """The best GFLOP/s of `torch.nn.functional.linear` on [m, k] x [n, k]^T in `dtype` over `repeats` calls."""
    a = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    for _ in range(3):
        torch.nn.functional.linear(a, w)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.nn.functional.linear(a, w)
        best = min(best, time.perf_counter() - t)
    return 2 * m * k * n / best / 1e9


def cpu_roofline(
    text_cfg, prompt_lens: list[int], output_lens: list[int], dtype: str, cached_lens: list[int] | None = None
) -> CpuRoofline:
    """The run's matmul work (prompts cached up to `cached_lens`) against this machine's GEMM rate for the model's
    MLP up-projection shape, and its bytes against the measured read bandwidth."""
    k, n = text_cfg.hidden_size, text_cfg.intermediate_size
    torch_dtype = getattr(torch, dtype)
    peak = measure_gemm_gflops(torch_dtype, k, n)
    element_size = torch.empty((), dtype=torch_dtype).element_size()
    return CpuRoofline(
        run_gflop(text_cfg, prompt_lens, output_lens, cached_lens),
        peak,
        (2048, k, n),
        sum(output_lens),
        run_gbytes(text_cfg, prompt_lens, output_lens, element_size),
        measure_read_gbs(),
        cached=bool(cached_lens),
    )


def format_roofline(roof: CpuRoofline, rates: dict[str, float]) -> str:
    """One line: the work and bytes, the measured rates, the ceiling, and each engine's tok/s as a share of it."""
    m, k, n = roof.shape
    shares = ", ".join(f"{name} {100 * rate / roof.ceiling_tok_s:.0f}%" for name, rate in rates.items())
    cached = " (prompts cached but their last token: the timed runs repeat them)" if roof.cached else ""
    return (
        f"CPU roofline: {roof.gflop:.1f} GFLOP of matmuls per run{cached} at the measured "
        f"{roof.peak_gflops:.0f} GFLOP/s "
        f"(linear [{m}x{k}] x [{k}x{n}]) = {roof.compute_seconds:.3f} s; {roof.gbytes:.2f} GB of weights and KV "
        f"at the measured {roof.bandwidth_gbs:.1f} GB/s = {roof.memory_seconds:.3f} s; {roof.bound}-bound -> at "
        f"most {roof.ceiling_tok_s:.0f} tok/s; {shares} of it"
    )
