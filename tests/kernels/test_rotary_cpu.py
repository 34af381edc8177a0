"""The C++ CPU rotary (`kernels.rotary_cpu`) against `rotary_ref.apply_rotary_ref`, bit for bit: float32 and bf16
tensors, float32 and bf16 caches, plain and M-RoPE positions, partial rotary, strided views of a fused qkv, a head
width off the 8-wide loop; and what falls back to the reference."""

from __future__ import annotations

import pytest
import torch

from vlserve.kernels import apply_rotary, apply_rotary_float32
from vlserve.kernels.rotary_cpu import DISABLE_ENV, apply_rotary_cpu, rotary_cpu_kernel
from vlserve.kernels.rotary_ref import apply_rotary_float32_ref, apply_rotary_ref, build_rotary_cache

pytestmark = pytest.mark.skipif(rotary_cpu_kernel() is None, reason="no C++ toolchain for the CPU rotary here")
CASES = [  # tokens, query heads, key heads, head dim, rotary dim, M-RoPE sections
    (37, 4, 2, 64, 64, None),
    (300, 8, 8, 64, 64, [16, 16, 0]),
    (5, 14, 2, 64, 64, [8, 12, 12]),
    (9, 3, 1, 80, 40, None),
    (7, 2, 2, 128, 128, [16, 24, 24]),
    (3, 2, 1, 20, 20, [4, 3, 3]),
]


def _case(seed, tokens, hq, hk, head_dim, rotary_dim, mrope, dtype, cache_dtype):
    g = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    cos, sin = (t.to(cache_dtype) for t in build_rotary_cache(inv_freq, 2048))
    qkv = (torch.randn(tokens, hq + 2 * hk, head_dim, generator=g) * 4).to(dtype)  # q and k: strided views
    positions = torch.randint(0, 2048, (3, tokens) if mrope else (tokens,), generator=g)
    return qkv[:, :hq], qkv[:, hq : hq + hk], positions, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_equal_bits_to_the_reference(dtype, cache_dtype, case):
    q, k, positions, cos, sin = _case(len(case), *case, dtype, cache_dtype)
    want_q, want_k = q.clone(), k.clone()
    apply_rotary_ref(want_q, want_k, positions, cos, sin, case[-1])
    apply_rotary_cpu(q, k, positions, cos, sin, case[-1])
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    head_dim, rotary_dim = case[3], case[4]
    if rotary_dim < head_dim:  # dims past the rotary ones untouched
        assert torch.equal(q[..., rotary_dim:], want_q[..., rotary_dim:])


def test_the_kernels_entry_point_runs_it_and_fallbacks_keep_the_reference(monkeypatch):
    q, k, positions, cos, sin = _case(0, *CASES[2], torch.bfloat16, torch.float32)
    want_q, want_k = q.clone(), k.clone()
    apply_rotary_ref(want_q, want_k, positions, cos, sin, CASES[2][-1])
    apply_rotary(q, k, positions, cos, sin, CASES[2][-1])
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    calls = []
    monkeypatch.setattr("vlserve.kernels.rotary_cpu.rotary_cpu_kernel", lambda: calls.append(1) or None)
    for dtype in (torch.float16,):  # a dtype the kernel does not take: the reference, same results
        q, k, positions, cos, sin = _case(1, *CASES[0], dtype, torch.float32)
        want_q, want_k = q.clone(), k.clone()
        apply_rotary_ref(want_q, want_k, positions, cos, sin)
        apply_rotary_cpu(q, k, positions, cos, sin)
        assert torch.equal(q, want_q) and torch.equal(k, want_k)
    monkeypatch.setenv(DISABLE_ENV, "0")
    q, k, positions, cos, sin = _case(2, *CASES[0], torch.float32, torch.float32)
    want_q = q.clone()
    apply_rotary_ref(want_q, k.clone(), positions, cos, sin)
    apply_rotary_cpu(q, k, positions, cos, sin)
    assert torch.equal(q, want_q) and calls == []  # switched off before the kernel is asked for


def test_bad_sections_are_a_value_error():
    q, k, positions, cos, sin = _case(3, *CASES[2], torch.float32, torch.float32)
    with pytest.raises(ValueError, match="mrope_section"):
        apply_rotary_cpu(q, k, positions, cos, sin, [8, 12, 10])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_float32_math_equal_bits_to_float32_copies(dtype, case):
    """Vision towers rotate bf16 q / k in float32 and round once: the kernel equals doing it on float32 copies."""
    q, k, positions, cos, sin = _case(len(case) + 7, *case, dtype, torch.float32)
    want_q, want_k = q.clone(), k.clone()
    apply_rotary_float32_ref(want_q, want_k, positions, cos, sin, case[-1])
    apply_rotary_cpu(q, k, positions, cos, sin, case[-1], float32_math=True)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    if dtype is torch.bfloat16:  # and it differs from the bf16 op-by-op rotation the decoder uses
        plain_q, plain_k = want_q.clone(), want_k.clone()
        q2, k2, *_ = _case(len(case) + 7, *case, dtype, torch.float32)
        apply_rotary_ref(q2, k2, positions, cos, sin, case[-1])
        assert not (torch.equal(q2, plain_q) and torch.equal(k2, plain_k))


def test_float32_math_dispatch_matches_the_reference():
    q, k, positions, cos, sin = _case(3, *CASES[2], torch.bfloat16, torch.float32)
    want_q, want_k = q.clone(), k.clone()
    apply_rotary_float32_ref(want_q, want_k, positions, cos, sin, CASES[2][-1])
    apply_rotary_float32(q, k, positions, cos, sin, CASES[2][-1])
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
