"""The work of a Qwen2-VL workload and this machine's limits: what `benchmarks.realsize` measures engines against.

FLOPs count the matrix products (2 per multiply-add): the vision tower per patch (patch embedding, each block's
qkv / projection / MLP and its full attention over the image's patches) plus the merger per merged token; the
prefill as 2 x matmul weights x prompt tokens, one logits row per request, and causal attention (a query at
position i reads i + 1 keys and values); the decode likewise for the fed-back tokens. Bytes count what each decode
step must read: every matmul weight once (logits projection included) and each request's cached K/V. The ideal
time of a phase is its FLOPs at the measured GEMM rate of its dtype, or its bytes at the measured read bandwidth,
whichever is longer; the fraction achieved is ideal / measured.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from vlserve.bench.cpu_report import measure_read_gbs


@dataclass(frozen=True)
class MachineLimits:
    """This machine's measured peaks on every core: GEMM GFLOP/s per dtype, read GB/s."""

    gemm_gflops: dict[str, float]
    read_gbs: float
    gemm_size: int

    def describe(self) -> str:
        rates = ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in self.gemm_gflops.items())
        return f"GEMM ({self.gemm_size}^3 matmul, best of a few): {rates}; read bandwidth {self.read_gbs:.1f} GB/s"


def measure_gemm_gflops(dtype: str, size: int, repeats: int = 3) -> float:
    """The best GFLOP/s of a [size, size] x [size, size] torch.matmul in `dtype` on every core, after a warm-up."""
    a = torch.randn(size, size).to(getattr(torch, dtype))
    b = torch.randn(size, size).to(getattr(torch, dtype))
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best / 1e9


def measure_limits(dtypes: list[str], gemm_size: int = 4096) -> MachineLimits:
    return MachineLimits(
        {d: measure_gemm_gflops(d, gemm_size) for d in dtypes}, measure_read_gbs(megabytes=512), gemm_size
    )


def vision_flops(vision_cfg, grids: list[tuple[int, int, int]]) -> float:
    """Matmul FLOPs of Qwen2-VL's vision tower on images of these (t, h, w) patch grids, merger included."""
    e, r = vision_cfg.embed_dim, vision_cfg.mlp_ratio
    in_dim = vision_cfg.in_channels * vision_cfg.temporal_patch_size * vision_cfg.patch_size**2
    merge = vision_cfg.spatial_merge_size**2
    total = 0.0
    for t, h, w in grids:
        patches, frame = t * h * w, h * w  # attention runs over each frame's patches
        per_block = 2 * e * e * (4 + 2 * r) * patches + 4 * frame * e * patches
        merged_in = merge * e
        merger = 2 * (patches // merge) * merged_in * (merged_in + vision_cfg.hidden_size)
        total += 2 * in_dim * e * patches + vision_cfg.depth * per_block + merger
    return total


@dataclass(frozen=True)
class _Decoder:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layer_weights: int  # q, k, v, o and the gated MLP's three projections of one layer

    @classmethod
    def of(cls, text_cfg) -> _Decoder:
        hidden, heads = text_cfg.hidden_size, text_cfg.num_attention_heads
        head_dim = getattr(text_cfg, "head_dim", None) or hidden // heads
        kv_heads = getattr(text_cfg, "num_key_value_heads", None) or heads
        weights = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
        weights += 3 * hidden * text_cfg.intermediate_size
        return cls(hidden, text_cfg.num_hidden_layers, heads, kv_heads, head_dim, text_cfg.vocab_size, weights)

    def token_flops(self, tokens: int) -> float:
        """Projections of `tokens` tokens through every layer (no logits, no attention)."""
        return 2.0 * tokens * self.layers * self.layer_weights

    def logits_flops(self, rows: int) -> float:
        return 2.0 * rows * self.hidden * self.vocab

    def attention_flops(self, contexts: int) -> float:
        """Scores and weighted sums of queries reading `contexts` keys in all (4 x head_dim a key, per head)."""
        return 4.0 * contexts * self.heads * self.head_dim * self.layers

    def step_bytes(self, element_size: int) -> float:
        """Weights one decode step reads: every layer's projections and the logits projection."""
        return float((self.layers * self.layer_weights + self.hidden * self.vocab) * element_size)

    def kv_bytes_per_position(self, element_size: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * element_size


def _causal_contexts(start: int, end: int) -> int:
    """Keys read by the queries at positions start .. end - 1 of one sequence (position i reads i + 1)."""
    return end * (end + 1) // 2 - start * (start + 1) // 2


def prefill_flops(text_cfg, prompt_lens: list[int]) -> float:
    """Prompts through the decoder, the first token's logits of each."""
    m = _Decoder.of(text_cfg)
    contexts = sum(_causal_contexts(0, p) for p in prompt_lens)
    return m.token_flops(sum(prompt_lens)) + m.logits_flops(len(prompt_lens)) + m.attention_flops(contexts)


def decode_flops(text_cfg, prompt_lens: list[int], output_len: int) -> float:
    """The output_len - 1 decode steps after the prefill: each fed-back token, its logits and its attention."""
    m = _Decoder.of(text_cfg)
    fed_back = len(prompt_lens) * (output_len - 1)
    contexts = sum(_causal_contexts(p, p + output_len - 1) for p in prompt_lens)
    return m.token_flops(fed_back) + m.logits_flops(fed_back) + m.attention_flops(contexts)


def decode_bytes(text_cfg, prompt_lens: list[int], output_len: int, element_size: int) -> float:
    """Bytes the output_len - 1 decode steps read: all weights each step (the whole batch in every step) and, per
    request, its K/V so far (decode step j of a prompt of p tokens reads p + j positions)."""
    m = _Decoder.of(text_cfg)
    steps = output_len - 1
    positions = sum(steps * p + steps * (steps + 1) // 2 for p in prompt_lens)
    return steps * m.step_bytes(element_size) + positions * m.kv_bytes_per_position(element_size)


@dataclass(frozen=True)
class WorkloadWork:
    """One workload's work: FLOPs of the towers, prefill and decode, and the decode's bytes."""

    requests: int
    output_len: int
    tower_flops: float
    prefill_flops: float
    decode_flops: float
    decode_bytes: float

    @classmethod
    def of(cls, config, prompt_lens: list[int], output_len: int, grids: list, element_size: int) -> WorkloadWork:
        text_cfg = config.get_text_config()
        tower = vision_flops(config.vision_config, grids) if grids else 0.0
        return cls(
            len(prompt_lens),
            output_len,
            tower,
            prefill_flops(text_cfg, prompt_lens),
            decode_flops(text_cfg, prompt_lens, output_len),
            decode_bytes(text_cfg, prompt_lens, output_len, element_size),
        )

    def ideal(self, limits: MachineLimits, dtype: str) -> dict[str, float]:
        """Shortest seconds of the first tokens (towers + prefill, compute-bound), of the decode (compute or
        bytes, the longer) and of both."""
        flops_per_s = limits.gemm_gflops[dtype] * 1e9
        first = (self.tower_flops + self.prefill_flops) / flops_per_s
        decode = max(self.decode_flops / flops_per_s, self.decode_bytes / (limits.read_gbs * 1e9))
        return {"first_tokens_s": first, "decode_s": decode, "total_s": first + decode}

    def as_dict(self) -> dict:
        return asdict(self)
