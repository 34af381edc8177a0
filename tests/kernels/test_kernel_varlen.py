"""Bidirectional varlen attention (vision towers): reference vs a plain loop, Triton (interpreter) vs reference."""

from __future__ import annotations

import itertools

import pytest
import torch
from _kernel_testutils import kernel_tol, to_device

import vlserve.kernels as K
from vlserve.kernels.varlen_attention_ref import varlen_attention_ref


def _naive_varlen(q, k, v, bounds, scale):
    """float64 softmax attention of every segment over itself only; GQA by head // group."""
    # q: [T, Hq, D]; k, v: [T, Hkv, D]; returns [T, Hq, D] in q.dtype (rows past bounds[-1] stay zero)
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for s, e in zip(bounds[:-1], bounds[1:]):
        for h in range(q.shape[1]):
            scores = q[s:e, h].double() @ k[s:e, h // group].double().T * scale  # [L, L]
            out[s:e, h] = torch.softmax(scores, dim=-1) @ v[s:e, h // group].double()
    return out.to(q.dtype)


def _case(bounds, num_q_heads, num_kv_heads, head_dim, dtype=torch.float32, pad_rows=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = bounds[-1] + pad_rows
    q = torch.randn(t, num_q_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v, torch.tensor(bounds, dtype=torch.int32)


# equal-length windows (batched together), a long segment spanning several tiles, an empty segment, one row
BOUNDS = [[0, 16, 32, 48, 48, 131, 132], [0, 70], [0, 1]]


@pytest.mark.parametrize("bounds,heads,head_dim", list(itertools.product(BOUNDS, [(2, 2), (4, 2)], [16, 80])))
def test_varlen_ref_matches_naive(bounds, heads, head_dim):
    q, k, v, cu = _case(bounds, *heads, head_dim, pad_rows=3)
    scale = head_dim**-0.5
    out = varlen_attention_ref(q, k, v, cu, scale)
    torch.testing.assert_close(out, _naive_varlen(q, k, v, bounds, scale), atol=2e-5, rtol=1e-5)
    assert out[bounds[-1] :].abs().max() == 0  # padding rows


@pytest.mark.parametrize(
    "bounds,heads,head_dim", [(BOUNDS[0], (2, 2), 16), (BOUNDS[0], (4, 2), 80), (BOUNDS[1], (3, 3), 40)]
)
def test_varlen_triton_matches_ref(bounds, heads, head_dim, device, triton_kernels):
    q, k, v, cu = _case(bounds, *heads, head_dim, pad_rows=2, seed=1)
    scale = head_dim**-0.5
    out = triton_kernels.varlen.varlen_attention_triton(*to_device(device, q, k, v, cu), scale)
    torch.testing.assert_close(out.cpu(), varlen_attention_ref(q, k, v, cu, scale), **kernel_tol(device, torch.float32))


def test_varlen_bf16_both_backends(device, triton_kernels):
    bounds = [0, 20, 57]
    q, k, v, cu = _case(bounds, 2, 2, 64, dtype=torch.bfloat16, seed=2)
    ref = _naive_varlen(q.float(), k.float(), v.float(), bounds, 0.125)
    torch.testing.assert_close(varlen_attention_ref(q, k, v, cu, 0.125).float(), ref, atol=2e-2, rtol=2e-2)
    out = triton_kernels.varlen.varlen_attention_triton(*to_device(device, q, k, v, cu), 0.125)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_varlen_dispatch(monkeypatch, backend, device, triton_dispatch):
    bounds = [0, 9, 30]
    q, k, v, cu = _case(bounds, 2, 1, 32, seed=3)
    monkeypatch.setenv(K.BACKEND_ENV, backend)
    dev = device if backend == "triton" else torch.device("cpu")
    out = K.varlen_attention(*to_device(dev, q, k, v, cu), 0.2, max_seqlen=21, cu_seqlens_cpu=bounds)
    torch.testing.assert_close(out.cpu(), _naive_varlen(q, k, v, bounds, 0.2), **kernel_tol(dev, torch.float32))
