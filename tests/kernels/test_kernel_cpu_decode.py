"""The C++ CPU decode kernel (`kernels.cpu_decode`) against the torch reference and a plain loop, and the engine's
use of it (attention_forward_ref routes decodes to it, or to the torch path when it is switched off)."""

from __future__ import annotations

import pytest
import torch
from _kernel_testutils import make_paged_kv, naive_attention, poison_unused_slots

from vlserve.kernels import attention_ref, cpu_decode
from vlserve.kernels.attention_ref import attention_forward_ref, paged_attention_decode_ref
from vlserve.kernels.cpu_decode import (
    attention_step_cpu,
    attention_step_supported,
    cpu_decode_kernel,
    cpu_decode_supported,
    paged_attention_decode_cpu,
)
from vlserve.kernels.kv_write_ref import write_kv_cache_ref
from vlserve.kernels.metadata import AttentionMetadata

pytestmark = pytest.mark.skipif(cpu_decode_kernel() is None, reason="no C++ toolchain for the CPU decode kernel")


def _case(ratio, head_dim, block_size, seq_lens, dtype, num_kv_heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    contexts = [
        tuple(torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype) for _ in range(2)) for n in seq_lens
    ]
    k_cache, v_cache, tables = make_paged_kv(contexts, block_size, generator=g)
    query = torch.randn(len(seq_lens), num_kv_heads * ratio, head_dim, generator=g).to(dtype)
    return query, contexts, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


# head dims 64 and 128 run the register-resident code, the others the general one; odd ratios leave a query row
# that is scored or accumulated alone; contexts past 256 positions take several softmax chunks
@pytest.mark.parametrize(
    "ratio,head_dim,block_size",
    [(1, 64, 16), (4, 64, 16), (8, 128, 32), (7, 128, 16), (2, 80, 16), (4, 96, 32), (3, 256, 8), (5, 64, 48)],
)
def test_cpu_decode_matches_naive_fp32(ratio, head_dim, block_size):
    seq_lens = [1, block_size // 2 + 3, block_size, 3 * block_size + 7, 200, 613]
    query, contexts, k_cache, v_cache, tables, lens = _case(ratio, head_dim, block_size, seq_lens, torch.float32)
    scale = head_dim**-0.5
    out = paged_attention_decode_cpu(query, k_cache, v_cache, tables, lens, scale)
    want = torch.stack(
        [naive_attention(query[b : b + 1], k, v, [k.shape[0] - 1], scale)[0] for b, (k, v) in enumerate(contexts)]
    )
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)


# bf16 scores go through vdpbf16ps where the CPU has AVX512-BF16 (head dims 64 and 128), else through widened
# float32 vectors; odd ratios score a row alone
@pytest.mark.parametrize("ratio,head_dim", [(4, 64), (7, 128), (3, 64), (2, 96)])
@pytest.mark.parametrize("dp", [0, 1])
def test_cpu_decode_bf16_close_to_reference(ratio, head_dim, dp, monkeypatch):
    if dp and not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("no AVX512-BF16 here")
    monkeypatch.setattr(cpu_decode, "_DP_BF16", dp)
    query, _, k_cache, v_cache, tables, lens = _case(ratio, head_dim, 16, [3, 16, 45, 130, 300], torch.bfloat16, seed=2)
    out = paged_attention_decode_cpu(query, k_cache, v_cache, tables, lens, 0.125)
    ref = paged_attention_decode_ref(query.float(), k_cache.float(), v_cache.float(), tables, lens, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    monkeypatch.setattr(cpu_decode, "_DP_BF16", 1 - dp)  # the other way of scoring: the same up to rounding
    torch.testing.assert_close(
        paged_attention_decode_cpu(query, k_cache, v_cache, tables, lens, 0.125).float(),
        out.float(),
        atol=1e-2,
        rtol=1e-2,
    )


def test_cpu_decode_never_reads_past_the_context():
    # NaN in every slot that holds no live token (stale or never written) must not reach the output
    seq_lens = [5, 16, 33]
    query, _, k_cache, v_cache, tables, lens = _case(2, 64, 16, seq_lens, torch.float32, seed=3)
    want = paged_attention_decode_ref(query, k_cache, v_cache, tables, lens, 0.125)
    poison_unused_slots(k_cache, v_cache, tables, seq_lens)
    out = paged_attention_decode_cpu(query, k_cache, v_cache, tables, lens, 0.125)
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)


def test_cpu_decode_empty_batch_and_strided_out():
    query, _, k_cache, v_cache, tables, lens = _case(2, 64, 16, [7, 9], torch.float32, seed=5)
    empty = paged_attention_decode_cpu(query[:0], k_cache, v_cache, tables[:0], lens[:0], 0.125)
    assert empty.shape == (0, 4, 64)
    big = torch.zeros(2, 4, 128)
    out = big[:, :, :64]  # not contiguous: filled through a copy
    paged_attention_decode_cpu(query, k_cache, v_cache, tables, lens, 0.125, out=out)
    torch.testing.assert_close(
        out, paged_attention_decode_ref(query, k_cache, v_cache, tables, lens, 0.125), atol=2e-5, rtol=1e-5
    )
    assert torch.equal(big[:, :, 64:], torch.zeros(2, 4, 64))


def test_cpu_decode_supported_rules(monkeypatch):
    q, k = torch.zeros(1, 4, 64), torch.zeros(2, 16, 2, 64)
    assert cpu_decode_supported(q, k)
    assert not cpu_decode_supported(q.half(), k.half())  # float16 is not built
    assert not cpu_decode_supported(torch.zeros(1, 4, 72), torch.zeros(2, 16, 2, 72))  # not whole vectors
    assert not cpu_decode_supported(torch.zeros(1, 4, 272), torch.zeros(2, 16, 2, 272))  # wider than 256
    assert not cpu_decode_supported(q, k.bfloat16())  # query and cache dtypes differ
    assert attention_step_supported(q, q[:, :2], k, k.clone())
    assert not attention_step_supported(q, q[:, :2].bfloat16(), k, k.clone())  # key not in the caches' dtype
    assert not attention_step_supported(q, q[:, :2], k, k.transpose(1, 2))  # a cache it cannot write in place
    monkeypatch.setenv(cpu_decode.DISABLE_ENV, "0")
    assert not cpu_decode_supported(q, k)


@pytest.mark.parametrize("kernel", ["1", "0"])
def test_attention_forward_decodes_alike_with_and_without_the_kernel(monkeypatch, kernel):
    # a mixed step: two decodes then a 3-token prefill; both decode paths give the reference's output
    monkeypatch.setenv(cpu_decode.DISABLE_ENV, kernel)
    calls = []
    real = attention_ref.attend_rows
    monkeypatch.setattr(attention_ref, "attend_rows", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    seq_lens = [20, 37, 9]
    query, contexts, k_cache, v_cache, tables, lens = _case(4, 64, 16, seq_lens, torch.float32, seed=6)
    q = torch.cat([query[:2], torch.randn(3, 8, 64)])  # [T=5, Hq, D]
    key = torch.cat([contexts[0][0][-1:], contexts[1][0][-1:], contexts[2][0][-3:]])
    value = torch.cat([contexts[0][1][-1:], contexts[1][1][-1:], contexts[2][1][-3:]])
    slots = [int(tables[b, (p) // 16]) * 16 + p % 16 for b, p in ((0, 19), (1, 36), (2, 6), (2, 7), (2, 8))]
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0, 1, 2, 5], dtype=torch.int32),
        seq_lens=lens,
        block_tables=tables,
        num_decodes=2,
        max_query_len=3,
        max_seq_len=37,
        query_start_loc_cpu=[0, 1, 2, 5],
        seq_lens_cpu=seq_lens,
    )
    out = attention_forward_ref(q, key, value, k_cache, v_cache, md, 0.125)
    want = paged_attention_decode_ref(q[:2], k_cache, v_cache, tables[:2], lens[:2], 0.125)
    torch.testing.assert_close(out[:2], want, atol=2e-5, rtol=1e-5)
    assert len(calls) == (1 if kernel == "1" else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_step_writes_then_decodes(dtype):
    # one call: the step's K/V land in their slots (slot -1 skipped, nothing else touched) before the decodes read
    # them; query and value are strided views of one fused projection while key is contiguous (as in the compiled
    # graph: the rows of the two are differently far apart), the block table a column slice of a wider one
    seq_lens = [9, 33, 70]
    query, contexts, k_cache, v_cache, tables, lens = _case(4, 64, 16, seq_lens, dtype, seed=8)
    fused = torch.randn(4, 8 * 64 + 2 * 2 * 64).to(dtype)  # [T, (Hq + 2 Hkv) * D]: the last row is padding
    q, k, v = fused.split([8 * 64, 2 * 64, 2 * 64], dim=1)
    q, k, v = q.view(4, 8, 64), k.reshape(4, 2, 64).contiguous(), v.view(4, 2, 64)
    slots = torch.tensor([int(tables[b, (n - 1) // 16]) * 16 + (n - 1) % 16 for b, n in enumerate(seq_lens)] + [-1])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(k, v, want_k, want_v, slots)
    wide = torch.zeros(3, tables.shape[1] + 5, dtype=torch.int32)
    wide[:, : tables.shape[1]] = tables
    out = torch.zeros(4, 8, 64, dtype=dtype)
    attention_step_cpu(q, k, v, k_cache, v_cache, slots, wide[:, : tables.shape[1]], lens, 3, 0.125, out)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    want = paged_attention_decode_ref(q[:3].float(), want_k.float(), want_v.float(), tables, lens, 0.125)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out[:3].float(), want, **tol)
    assert torch.equal(out[3], torch.zeros(8, 64, dtype=dtype))  # rows past num_decodes are the caller's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("long_chunk", [False, True])
def test_attention_forward_takes_short_prefill_chunks_in_the_kernel(monkeypatch, dtype, long_chunk):
    # decodes, a whole 5-token prompt, a 4-token chunk over a cached prefix and a 2-token one (e.g. a verification);
    # with a chunk longer than MAX_KERNEL_QUERY_LEN the chunks go to the torch prefill path instead. Every row must
    # equal the torch path's output (kernel switched off) and causal attention computed directly.
    q_lens = [1, 1, 5, 4, 2] + ([cpu_decode.MAX_KERNEL_QUERY_LEN + 1] if long_chunk else [])
    seq_lens = [20, 37, 5, 40, 18] + ([70] if long_chunk else [])
    query, contexts, k_cache, v_cache, tables, lens = _case(4, 64, 16, seq_lens, dtype, seed=9)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], 8, 64).to(dtype)
    key = torch.cat([k[-n:] for (k, _), n in zip(contexts, q_lens)])
    value = torch.cat([v[-n:] for (_, v), n in zip(contexts, q_lens)])
    slots = [
        int(tables[b, p // 16]) * 16 + p % 16 for b, (n, L) in enumerate(zip(q_lens, seq_lens)) for p in range(L - n, L)
    ]
    rows = cpu_decode.kernel_rows(qsl, seq_lens, 2)

    def forward(kernel: str) -> torch.Tensor:
        monkeypatch.setenv(cpu_decode.DISABLE_ENV, kernel)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=lens,
            block_tables=tables,
            num_decodes=2,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )
        return attention_forward_ref(q, key, value, k_cache, v_cache, md, 0.125)

    calls = []
    real = attention_ref._prefill_from_lists
    monkeypatch.setattr(attention_ref, "_prefill_from_lists", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = forward("1")
    assert calls == ([1] if long_chunk else []) and rows[0] == (2 if long_chunk else qsl[-1])
    torch_path = forward("0")
    want = torch.cat(
        [
            naive_attention(
                q[qsl[b] : qsl[b + 1]].float(),
                k.float(),
                v.float(),
                list(range(seq_lens[b] - q_lens[b], seq_lens[b])),
                0.125,
            )
            for b, (k, v) in enumerate(contexts)
        ]
    )
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    torch.testing.assert_close(got.float(), torch_path.float(), **tol)


def test_kernel_rows_lists_each_chunk_token_with_its_causal_length():
    n, seqs, lens = cpu_decode.kernel_rows([0, 1, 4, 6], [9, 5, 30], num_decodes=1)
    assert n == 6 and seqs.tolist() == [0, 1, 1, 1, 2, 2] and lens.tolist() == [9, 3, 4, 5, 29, 30]
    assert cpu_decode.kernel_rows([0, 1, 2], [9, 5], num_decodes=2) == (2, None, None)  # decodes only
    assert cpu_decode.kernel_rows([0, 1, 40], [9, 50], num_decodes=1, max_query_len=32) == (1, None, None)
    with pytest.raises(ValueError, match="q_len 4 > seq_len 3"):
        cpu_decode.kernel_rows([0, 4], [3], num_decodes=0)
