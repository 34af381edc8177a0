"""Sliding-window paged attention (query at p sees keys p - W + 1 .. p, HF's convention): the torch reference
against a plain loop, the C++ CPU kernel and the Triton kernels (interpreted on CPU) against the reference."""

from __future__ import annotations

import pytest
import torch
from _kernel_testutils import build_metadata, kernel_tol, make_paged_kv, metadata_to, to_device

from vlserve import kernels
from vlserve.kernels import cpu_decode
from vlserve.kernels.attention_op import attention_step, paged_attention
from vlserve.kernels.attention_ref import attention_forward_ref, paged_attention_decode_ref, paged_prefill_attention_ref

BS = 16
# windows: one key, inside a block, exactly a block, spanning blocks, longer than every context
WINDOWS = [1, 5, 16, 23, 40, 1000]


def _naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: list[int], scale: float, window: int | None
) -> torch.Tensor:
    # q: [n, Hq, D]; k, v: [S, Hkv, D]; float64 loop over keys max(0, p - W + 1) .. p -> [n, Hq, D]
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, pos in enumerate(q_positions):
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(q.shape[1]):
            kh, vh = k[lo : pos + 1, h // group].double(), v[lo : pos + 1, h // group].double()
            w = torch.softmax((kh @ q[i, h].double()) * scale, 0)
            out[i, h] = w @ vh
    return out.to(q.dtype)


def _step_case(q_lens, seq_lens, ratio=2, head_dim=64, num_kv_heads=2, dtype=torch.float32, seed=0):
    """A step of sequences whose new tokens are the last q_len of seq_len positions (decodes first)."""
    g = torch.Generator().manual_seed(seed)
    contexts = [
        tuple(torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype) for _ in range(2)) for n in seq_lens
    ]
    k_cache, v_cache, tables = make_paged_kv(contexts, BS, generator=g)
    num_decodes = sum(1 for n in q_lens if n == 1)
    md = build_metadata(q_lens, seq_lens, tables, BS, num_decodes=num_decodes)
    key = torch.cat([k[L - n :] for (k, _), n, L in zip(contexts, q_lens, seq_lens)])
    value = torch.cat([v[L - n :] for (_, v), n, L in zip(contexts, q_lens, seq_lens)])
    query = torch.randn(key.shape[0], num_kv_heads * ratio, head_dim, generator=g).to(dtype)
    return query, key, value, contexts, k_cache, v_cache, md


def _expected(query, contexts, md, scale, window):
    qsl = md.query_start_loc_cpu
    return torch.cat(
        [
            _naive(
                query[qsl[b] : qsl[b + 1]].float(),
                k.float(),
                v.float(),
                list(range(md.seq_lens_cpu[b] - (qsl[b + 1] - qsl[b]), md.seq_lens_cpu[b])),
                scale,
                window,
            )
            for b, (k, v) in enumerate(contexts)
        ]
    )


# two decodes, a whole prompt, a chunk over a cached prefix, a long chunk (past the C++ kernel's row limit)
MIXED = ([1, 1, 7, 9, 40], [30, 53, 7, 50, 75])


@pytest.mark.parametrize("window", WINDOWS)
def test_ref_paths_match_naive(monkeypatch, window):
    monkeypatch.setenv(cpu_decode.DISABLE_ENV, "0")  # the torch decode and prefill paths
    query, key, value, contexts, k_cache, v_cache, md = _step_case(*MIXED, seed=window)
    out = attention_forward_ref(query, key, value, k_cache, v_cache, md, 0.125, sliding_window=window)
    torch.testing.assert_close(out, _expected(query, contexts, md, 0.125, window), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [3, 16, 17, 33])
@pytest.mark.parametrize("seq_lens", [[1, 9, 16, 55, 90], [40, 40, 40]])  # ragged (masked chunks), one length
def test_decode_ref_matches_naive(window, seq_lens):
    query, _, _, contexts, k_cache, v_cache, md = _step_case([1] * len(seq_lens), seq_lens, ratio=4, seed=1)
    out = paged_attention_decode_ref(
        query, k_cache, v_cache, md.block_tables, md.seq_lens, 0.125, sliding_window=window
    )
    torch.testing.assert_close(out, _expected(query, contexts, md, 0.125, window), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 8, 16, 21])
def test_prefill_ref_matches_naive(window):
    query, _, _, contexts, k_cache, v_cache, md = _step_case([12, 33, 5], [12, 70, 37], seed=2)
    out = paged_prefill_attention_ref(
        query, k_cache, v_cache, md.block_tables, md.query_start_loc, md.seq_lens, 0.125, sliding_window=window
    )
    torch.testing.assert_close(out, _expected(query, contexts, md, 0.125, window), atol=2e-5, rtol=1e-5)


def test_window_changes_the_output():
    query, key, value, contexts, k_cache, v_cache, md = _step_case(*MIXED)
    full = attention_forward_ref(query, key, value, k_cache.clone(), v_cache.clone(), md, 0.125)
    windowed = attention_forward_ref(query, key, value, k_cache, v_cache, md, 0.125, sliding_window=8)
    assert not torch.allclose(full[:2], windowed[:2], atol=1e-3)  # the decodes see 30 and 53 > 8 keys


needs_cpu_kernel = pytest.mark.skipif(cpu_decode.cpu_decode_kernel() is None, reason="no C++ toolchain")


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", WINDOWS)
def test_cpu_kernel_matches_torch_path(monkeypatch, dtype, window):
    # decodes and short prefill chunks (all rows in the C++ call), against the torch path and the plain loop
    q_lens, seq_lens = [1, 1, 1, 7, 9, 3], [30, 53, 16, 7, 50, 33]
    query, key, value, contexts, k_cache, v_cache, md = _step_case(q_lens, seq_lens, ratio=4, dtype=dtype, seed=3)

    def forward(kernel: str) -> torch.Tensor:
        monkeypatch.setenv(cpu_decode.DISABLE_ENV, kernel)
        return attention_forward_ref(
            query,
            key,
            value,
            k_cache.clone(),
            v_cache.clone(),
            build_metadata(q_lens, seq_lens, md.block_tables, BS, 3),
            0.125,
            sliding_window=window,
        )

    got, torch_path = forward("1"), forward("0")
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), _expected(query, contexts, md, 0.125, window), **tol)
    torch.testing.assert_close(got.float(), torch_path.float(), **tol)


@needs_cpu_kernel
@pytest.mark.parametrize("window", [7, 100, 300])
def test_cpu_decode_long_contexts(window):
    # contexts of several ~256-position softmax chunks: the window starts in a later chunk, mid-block
    seq_lens = [600, 333, 90]
    query, _, _, contexts, k_cache, v_cache, md = _step_case([1, 1, 1], seq_lens, ratio=2, seed=4)
    out = cpu_decode.paged_attention_decode_cpu(
        query, k_cache, v_cache, md.block_tables, md.seq_lens, 0.125, sliding_window=window
    )
    ref = paged_attention_decode_ref(
        query, k_cache, v_cache, md.block_tables, md.seq_lens, 0.125, sliding_window=window
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out, _expected(query, contexts, md, 0.125, window), atol=2e-5, rtol=1e-5)


def test_dispatch_and_compiled_op_pass_the_window():
    query, key, value, contexts, k_cache, v_cache, md = _step_case(*MIXED, seed=5)
    want = _expected(query, contexts, md, 0.125, 8)
    out = kernels.attention_forward(query, key, value, k_cache.clone(), v_cache.clone(), md, 0.125, sliding_window=8)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
    with attention_step(md, [(k_cache, v_cache)]):
        out = paged_attention(query, key, value, 0, 0.125, 1.0, 1.0, 8)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 16, 23, 40])
def test_triton_decode_matches_ref(triton_kernels, device, window):
    seq_lens = [1, 9, 16, 55, 90]
    query, _, _, _, k_cache, v_cache, md = _step_case([1] * 5, seq_lens, ratio=4, seed=6)
    ref = paged_attention_decode_ref(
        query, k_cache, v_cache, md.block_tables, md.seq_lens, 0.125, sliding_window=window
    )
    q2, k2, v2, tables, lens = to_device(device, query, k_cache, v_cache, md.block_tables, md.seq_lens)
    for splits in (1, 3):  # one program per sequence, and split-K partials merged by the reduce kernel
        out = triton_kernels.attention.paged_attention_decode_triton(
            q2, k2, v2, tables, lens, 0.125, max_seq_len=max(seq_lens), num_splits=splits, sliding_window=window
        )
        torch.testing.assert_close(out.cpu(), ref, **kernel_tol(device, torch.float32))


# 100: the long chunk's tiles are skipped (below every row's window), masked, unmasked, then masked on the diagonal
@pytest.mark.parametrize("window", [1, 5, 16, 23, 40, 100])
def test_triton_prefill_matches_ref(triton_kernels, device, window):
    query, _, _, contexts, k_cache, v_cache, md = _step_case([12, 33, 5, 70], [12, 70, 37, 300], seed=7)
    ref = paged_prefill_attention_ref(
        query, k_cache, v_cache, md.block_tables, md.query_start_loc, md.seq_lens, 0.125, sliding_window=window
    )
    q2, k2, v2, tables, qsl, lens = to_device(
        device, query, k_cache, v_cache, md.block_tables, md.query_start_loc, md.seq_lens
    )
    out = triton_kernels.prefill.paged_prefill_attention_triton(
        q2, k2, v2, tables, qsl, lens, 0.125, sliding_window=window
    )
    torch.testing.assert_close(out.cpu(), ref, **kernel_tol(device, torch.float32))
    torch.testing.assert_close(ref, _expected(query, contexts, md, 0.125, window), atol=2e-5, rtol=1e-5)


def test_triton_attention_forward_matches_ref(triton_kernels, device):
    query, key, value, contexts, k_cache, v_cache, md = _step_case(*MIXED, seed=8)
    ref = attention_forward_ref(query, key, value, k_cache.clone(), v_cache.clone(), md, 0.125, sliding_window=20)
    q2, key2, value2, k2, v2 = to_device(device, query, key, value, k_cache, v_cache)
    out = triton_kernels.attention.attention_forward_triton(
        q2, key2, value2, k2, v2, metadata_to(md, device), 0.125, sliding_window=20
    )
    torch.testing.assert_close(out.cpu(), ref, **kernel_tol(device, torch.float32))
