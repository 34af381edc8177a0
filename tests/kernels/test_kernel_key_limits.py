"""Per-query key limits (`AttentionMetadata.key_limits`, Gemma 3's bidirectional image runs): the torch path, the C++
CPU path (decodes in C++, prefill chunks in torch) and the Triton path's torch fallback against plain SDPA with the
mask of the definition (query q with limit h sees key k iff k <= h, and k > q - W with a window W)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from _kernel_testutils import build_metadata, kernel_tol, metadata_to, to_device
from test_kernel_sliding_window import BS, _step_case, needs_cpu_kernel

from vlserve import kernels
from vlserve.kernels import cpu_decode
from vlserve.kernels.attention_op import attention_step, paged_attention
from vlserve.kernels.attention_ref import attention_forward_ref
from vlserve.kernels.key_limits import bidirectional_prefills
from vlserve.kernels.metadata import AttentionMetadata

SCALE = 0.125
# (q_lens, seq_lens, image runs (first, last) per sequence, GQA ratio): decodes first, as the runner orders them
CASES = {
    "one_run": ([20], [20], [[(5, 12)]], 2),
    # a run at the very start and one ending at the chunk's last token
    "two_runs_at_edges": ([24], [24], [[(0, 6), (15, 23)]], 2),
    # a chunk of 18 over a cached prefix of 32: both runs in the chunk, the second ends at its last token
    "chunk_over_prefix": ([18], [50], [[(34, 41), (46, 49)]], 4),
    # decodes, a text-only chunk, a short image chunk (the C++ call's rows without key limits), a long chunk
    "mixed_step": ([1, 1, 9, 7, 40], [30, 53, 50, 7, 75], [[], [], [], [(1, 4)], [(40, 60)]], 4),
    "mha": ([1, 16], [40, 30], [[], [(20, 27)]], 1),
}
WINDOWS = [None, 3, 40]  # full; smaller than every run; larger than the runs, smaller than the longest contexts


def _own_positions(md: AttentionMetadata) -> torch.Tensor:
    """[T] int64: each query token's position (seq_len - q_len + i)."""
    qsl = md.query_start_loc_cpu
    return torch.cat(
        [torch.arange(md.seq_lens_cpu[b] - (qsl[b + 1] - qsl[b]), md.seq_lens_cpu[b]) for b in range(md.num_seqs)]
    )


def _limits(md: AttentionMetadata, runs: list[list[tuple[int, int]]]) -> torch.Tensor:
    """[T] int64: own positions, raised to the run's last position inside each run."""
    limits, qsl = _own_positions(md), md.query_start_loc_cpu
    for b, seq_runs in enumerate(runs):
        first_pos = md.seq_lens_cpu[b] - (qsl[b + 1] - qsl[b])
        for first, last in seq_runs:
            lo = qsl[b] + max(first, first_pos) - first_pos
            limits[lo : qsl[b] + last - first_pos + 1] = last
    return limits


def _with_limits(md: AttentionMetadata, limits: torch.Tensor | None) -> AttentionMetadata:
    """A fresh copy of `md` (nothing derived yet) with `key_limits`."""
    return dataclasses.replace(md, key_limits=limits, derived={})


def _dense(query, contexts, md, limits, window):
    """float64 SDPA per sequence with the definition's explicit mask -> [T, Hq, D]."""
    qsl, outs = md.query_start_loc_cpu, []
    for b, (k, v) in enumerate(contexts):
        seq_len, n = md.seq_lens_cpu[b], qsl[b + 1] - qsl[b]
        q_pos, k_pos = torch.arange(seq_len - n, seq_len), torch.arange(seq_len)
        mask = k_pos[None, :] <= limits[qsl[b] : qsl[b + 1], None]  # [n, S]
        if window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        q, kk, vv = (t.double().transpose(0, 1) for t in (query[qsl[b] : qsl[b + 1]], k, v))
        outs.append(
            F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=SCALE, enable_gqa=True).transpose(0, 1)
        )
    return torch.cat(outs)


def _forward(monkeypatch, path, query, key, value, k_cache, v_cache, md, window):
    monkeypatch.setenv(cpu_decode.DISABLE_ENV, "1" if path == "cpp" else "0")
    return attention_forward_ref(query, key, value, k_cache.clone(), v_cache.clone(), md, SCALE, sliding_window=window)


PATHS = ["torch", pytest.param("cpp", marks=needs_cpu_kernel)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_dense(monkeypatch, path, dtype, window, name):
    q_lens, seq_lens, runs, ratio = CASES[name]
    query, key, value, contexts, k_cache, v_cache, md = _step_case(
        q_lens, seq_lens, ratio=ratio, dtype=dtype, seed=len(name)
    )
    if path == "cpp" and not cpu_decode.attention_step_supported(query, key, k_cache, v_cache):
        pytest.skip("the C++ call does not take these tensors")
    limits = _limits(md, runs)
    got = _forward(monkeypatch, path, query, key, value, k_cache, v_cache, _with_limits(md, limits), window)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.double(), _dense(query, contexts, md, limits, window), **tol)
    causal = _forward(monkeypatch, path, query, key, value, k_cache, v_cache, _with_limits(md, None), window)
    assert torch.equal(got[: md.num_decodes], causal[: md.num_decodes])  # decode rows stay exact
    assert not torch.allclose(got.float(), causal.float(), atol=1e-2)  # the runs changed the output


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_own_position_limits_are_causal(monkeypatch, path, dtype, window):
    # the mixed step: short chunks stay in the C++ call, the output is bit for bit the causal one
    q_lens, seq_lens, _, ratio = CASES["mixed_step"]
    query, key, value, _, k_cache, v_cache, md = _step_case(q_lens, seq_lens, ratio=ratio, dtype=dtype, seed=11)
    own = _forward(monkeypatch, path, query, key, value, k_cache, v_cache, _with_limits(md, _own_positions(md)), window)
    causal = _forward(monkeypatch, path, query, key, value, k_cache, v_cache, _with_limits(md, None), window)
    assert torch.equal(own, causal)


def test_bidirectional_prefills_flags():
    q_lens, seq_lens, runs, _ = CASES["mixed_step"]
    md = _step_case(q_lens, seq_lens)[-1]
    assert bidirectional_prefills(_with_limits(md, None)) == ()
    assert bidirectional_prefills(_with_limits(md, _own_positions(md))) == ()
    with_runs = _with_limits(md, _limits(md, runs))
    assert bidirectional_prefills(with_runs) == (False, True, True)  # one per prefill sequence
    assert with_runs.derived["bidirectional_prefills"] == (False, True, True)  # kept for the step's other layers


def test_padding_rows_and_dispatch_and_compiled_op():
    # padding rows past the batch come out zero; the dispatcher and the custom op read key_limits from the metadata
    q_lens, seq_lens, runs, ratio = CASES["mixed_step"]
    query, key, value, contexts, k_cache, v_cache, md = _step_case(q_lens, seq_lens, ratio=ratio, seed=12)
    limits = _limits(md, runs)
    want = _dense(query, contexts, md, limits, 40)
    padded = build_metadata(q_lens, seq_lens, md.block_tables, BS, md.num_decodes, num_padding_tokens=3)
    padded.key_limits = torch.cat([limits, torch.zeros(3, dtype=torch.long)])  # the runner's padding limits: 0
    pad = lambda t: torch.cat([t, torch.randn(3, *t.shape[1:])])  # noqa: E731
    out = kernels.attention_forward(
        pad(query), pad(key), pad(value), k_cache.clone(), v_cache.clone(), padded, SCALE, sliding_window=40
    )
    torch.testing.assert_close(out[:-3].double(), want, atol=2e-5, rtol=1e-5)
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))
    with attention_step(_with_limits(md, limits), [(k_cache.clone(), v_cache.clone())]):
        out = paged_attention(query, key, value, 0, SCALE, 1.0, 1.0, 40)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_triton_fallback_matches_ref(triton_kernels, device, window):
    # decodes on the Triton kernel, the prefill sequences through the torch path on the device
    q_lens, seq_lens, runs = [1, 6, 9], [20, 6, 25], [[], [(0, 3)], [(18, 24)]]
    query, key, value, contexts, k_cache, v_cache, md = _step_case(q_lens, seq_lens, seed=13)
    limits = _limits(md, runs)
    want = _dense(query, contexts, md, limits, window)
    q2, key2, value2, k2, v2 = to_device(device, query, key, value, k_cache, v_cache)
    forward = triton_kernels.attention.attention_forward_triton
    out = forward(q2, key2, value2, k2, v2, metadata_to(_with_limits(md, limits), device), SCALE, sliding_window=window)
    torch.testing.assert_close(out.cpu().double(), want, **kernel_tol(device, torch.float32))
    # own positions: the Triton prefill runs, as without limits
    causal = forward(
        q2, key2, value2, k2, v2, metadata_to(_with_limits(md, None), device), SCALE, sliding_window=window
    )
    own = forward(
        q2,
        key2,
        value2,
        k2,
        v2,
        metadata_to(_with_limits(md, _own_positions(md)), device),
        SCALE,
        sliding_window=window,
    )
    assert torch.equal(own, causal)
    assert torch.equal(out[:1], causal[:1])  # the decode row
