"""FP8 (float8_e4m3fn) KV caches in every kernel path: the torch twins, the Triton kernels (interpreted on CPU, compiled
on CUDA) and the C++ CPU decode kernel.

Each path is checked twice: against the reference computed on the same fp8-rounded K/V dequantized to float32
(tight: the float32 tolerances of the other kernel tests), and against the unquantized cache (loose: LOOSE below,
about what 3 mantissa bits cost: an e4m3 value is within 1/16 of its input; measured here, mean absolute error ~0.01
on outputs of mean magnitude ~0.33). Writers are checked byte for byte against `quantize_kv`.
"""

from __future__ import annotations

import pytest
import torch
from _kernel_testutils import build_metadata, kernel_tol, make_paged_kv, metadata_to, poison_unused_slots, to_device

from vlserve.config import EngineArgs
from vlserve.kernels import attention_ref, cpu_decode
from vlserve.kernels.attention_ref import attention_forward_ref, paged_attention_decode_ref, paged_prefill_attention_ref
from vlserve.kernels.cpu_decode import attention_step_cpu, cpu_decode_kernel, paged_attention_decode_cpu
from vlserve.kernels.kv_quant import FP8_KV_DTYPE, dequantize_kv, kv_cache_torch_dtype, quantize_kv
from vlserve.kernels.kv_write_ref import write_kv_cache_ref

K_SCALE, V_SCALE = 0.011, 0.0093  # about amax / 448 for randn data, as a calibrated checkpoint would carry
LOOSE = dict(atol=0.1, rtol=0.1)  # fp8 vs unquantized: e4m3 keeps 3 mantissa bits (relative step 1/8)
TIGHT = dict(atol=2e-5, rtol=1e-5)  # the same fp8 values dequantized to float32: only summation order differs
needs_cpp = pytest.mark.skipif(cpu_decode_kernel() is None, reason="no C++ toolchain for the CPU decode kernel")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _case(seq_lens, ratio=4, head_dim=64, block_size=16, num_kv_heads=2, dtype=torch.float32, seed=0):
    """Float caches (unused slots: large garbage), their fp8 twins, the dequantized float32 twins, tables."""
    g = torch.Generator().manual_seed(seed)
    contexts = [tuple(torch.randn(n, num_kv_heads, head_dim, generator=g) for _ in range(2)) for n in seq_lens]
    k_cache, v_cache, tables = make_paged_kv(contexts, block_size, generator=g)
    k8, v8 = quantize_kv(k_cache, K_SCALE), quantize_kv(v_cache, V_SCALE)
    kd, vd = dequantize_kv(k8, K_SCALE, torch.float32), dequantize_kv(v8, V_SCALE, torch.float32)
    query = torch.randn(len(seq_lens), num_kv_heads * ratio, head_dim, generator=g).to(dtype)
    return query, (k_cache, v_cache), (k8, v8), (kd, vd), tables, torch.tensor(seq_lens, dtype=torch.int32)


def _prefill_case(q_lens, seq_lens, seed=1, **kw):
    _, full, fp8, deq, tables, lens = _case(seq_lens, seed=seed, **kw)
    g = torch.Generator().manual_seed(seed + 100)
    query = torch.randn(sum(q_lens), full[0].shape[2] * kw.get("ratio", 4), full[0].shape[3], generator=g)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return query, full, fp8, deq, tables, qsl, lens


# --- the rule ----------------------------------------------------------------------------------------------------


def test_quantize_rule_and_dtype_names(monkeypatch):
    x = torch.tensor([1000.0, -1000.0, 1.95, 0.3, 1e-5, 0.0])
    q = quantize_kv(x, 2.0)
    assert q.dtype == FP8_KV_DTYPE
    assert q.float().tolist() == [448.0, -448.0, 1.0, 0.15625, 0.0, 0.0]  # clamped, rounded to e4m3
    assert dequantize_kv(q, 2.0, torch.float32).tolist() == [896.0, -896.0, 2.0, 0.3125, 0.0, 0.0]
    assert kv_cache_torch_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.float32) is FP8_KV_DTYPE
    assert kv_cache_torch_dtype("fp8_e4m3", torch.bfloat16) is FP8_KV_DTYPE
    with monkeypatch.context() as m:  # GPUs without e4m3 conversions in Triton are refused by name
        m.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        with pytest.raises(ValueError, match="compute capability 8.9 or newer"):
            kv_cache_torch_dtype("fp8", torch.bfloat16, torch.device("cuda", 0))
        m.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        assert kv_cache_torch_dtype("fp8", torch.bfloat16, torch.device("cuda", 0)) is FP8_KV_DTYPE
    for bad in ("fp8_e5m2", "int8", "bf16"):
        with pytest.raises(ValueError, match="auto, fp8, fp8_e4m3"):
            kv_cache_torch_dtype(bad, torch.float32)
        with pytest.raises(ValueError, match="auto, fp8, fp8_e4m3"):
            EngineArgs(kv_cache_dtype=bad)


# --- torch twins -------------------------------------------------------------------------------------------------


def test_write_ref_stores_quantized_bytes():
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(5, 2, 64, generator=g) * 3, torch.randn(5, 2, 64, generator=g)
    k8, v8 = torch.zeros(4, 16, 2, 64, dtype=FP8_KV_DTYPE), torch.zeros(4, 16, 2, 64, dtype=FP8_KV_DTYPE)
    slots = torch.tensor([0, 17, -1, 63, 40])
    write_kv_cache_ref(key, value, k8, v8, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(_bytes(k8.view(-1, 2, 64)[s]), _bytes(quantize_kv(key[t], K_SCALE)))
            assert torch.equal(_bytes(v8.view(-1, 2, 64)[s]), _bytes(quantize_kv(value[t], V_SCALE)))
    assert _bytes(k8.view(-1, 2, 64)[1]).eq(0).all()  # untouched


@pytest.mark.parametrize("ratio,head_dim,block_size", [(1, 64, 16), (4, 80, 32), (7, 128, 16)])
def test_decode_ref_fp8(ratio, head_dim, block_size):
    seq_lens = [1, block_size + 3, 3 * block_size + 7, 200]
    query, full, fp8, deq, tables, lens = _case(seq_lens, ratio, head_dim, block_size)
    scale = head_dim**-0.5
    out = paged_attention_decode_ref(query, *fp8, tables, lens, scale, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out, paged_attention_decode_ref(query, *deq, tables, lens, scale), **TIGHT)
    torch.testing.assert_close(out, paged_attention_decode_ref(query, *full, tables, lens, scale), **LOOSE)


def test_decode_ref_fp8_padded_chunk_and_workspace():
    # mixed lengths in one chunk: the padded positions are zeroed through a byte view; an fp8 workspace is used
    query, _, fp8, deq, tables, lens = _case([5, 33, 17], seed=4)
    poison_unused_slots(*deq, tables, [5, 33, 17])
    ws = torch.empty(1 << 16, dtype=FP8_KV_DTYPE)
    out = paged_attention_decode_ref(query, *fp8, tables, lens, 0.125, workspace=ws, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out, paged_attention_decode_ref(query, *deq, tables, lens, 0.125), **TIGHT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_ref_fp8(dtype):
    query, full, fp8, deq, tables, qsl, lens = _prefill_case([7, 20, 1], [30, 20, 9])
    query = query.to(dtype)
    out = paged_prefill_attention_ref(query, *fp8, tables, qsl, lens, 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    want = paged_prefill_attention_ref(query.float(), *deq, tables, qsl, lens, 0.125)
    tight = TIGHT if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)  # bf16: K/V rounded to bf16 for SDPA
    torch.testing.assert_close(out.float(), want, **tight)
    torch.testing.assert_close(
        out.float(), paged_prefill_attention_ref(query.float(), *full, tables, qsl, lens, 0.125), **LOOSE
    )


# --- Triton --------------------------------------------------------------------------------------------------------


def test_triton_write_matches_torch_bytes(triton_kernels, device):
    g = torch.Generator().manual_seed(5)
    key, value = torch.randn(9, 4, 80, generator=g) * 2, torch.randn(9, 4, 80, generator=g) * 0.01
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 1.95 * K_SCALE, 2e-3 * K_SCALE])  # clamp, carry, subnormal
    slots = torch.tensor([0, 15, -1, 16, 53, 95, -1, 39, 2])
    want_k, want_v = torch.zeros(6, 16, 4, 80, dtype=FP8_KV_DTYPE), torch.zeros(6, 16, 4, 80, dtype=FP8_KV_DTYPE)
    write_kv_cache_ref(key, value, want_k, want_v, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    k8, v8, key_d, value_d, slots_d = to_device(
        device, torch.zeros_like(want_k), torch.zeros_like(want_v), key, value, slots
    )
    triton_kernels.kv_write.write_kv_cache_triton(key_d, value_d, k8, v8, slots_d, k_scale=K_SCALE, v_scale=V_SCALE)
    assert torch.equal(_bytes(k8.cpu()), _bytes(want_k)) and torch.equal(_bytes(v8.cpu()), _bytes(want_v))


@pytest.mark.parametrize("ratio,head_dim", [(4, 64), (2, 80)])
def test_triton_decode_fp8(triton_kernels, device, ratio, head_dim):
    seq_lens = [1, 19, 70, 130]
    query, full, fp8, deq, tables, lens = _case(seq_lens, ratio, head_dim, seed=6)
    scale = head_dim**-0.5
    out = triton_kernels.attention.paged_attention_decode_triton(
        *to_device(device, query, *fp8, tables, lens), scale, max_seq_len=130, k_scale=K_SCALE, v_scale=V_SCALE
    ).cpu()
    torch.testing.assert_close(
        out, paged_attention_decode_ref(query, *deq, tables, lens, scale), **kernel_tol(device, torch.float32)
    )
    torch.testing.assert_close(out, paged_attention_decode_ref(query, *full, tables, lens, scale), **LOOSE)


def test_triton_prefill_fp8(triton_kernels, device):
    query, full, fp8, deq, tables, qsl, lens = _prefill_case([7, 20, 1], [30, 20, 9], seed=7)
    out = triton_kernels.prefill.paged_prefill_attention_triton(
        *to_device(device, query, *fp8, tables, qsl, lens), 0.125, k_scale=K_SCALE, v_scale=V_SCALE
    ).cpu()
    torch.testing.assert_close(
        out, paged_prefill_attention_ref(query, *deq, tables, qsl, lens, 0.125), **kernel_tol(device, torch.float32)
    )
    torch.testing.assert_close(out, paged_prefill_attention_ref(query, *full, tables, qsl, lens, 0.125), **LOOSE)


def _mixed_step(seed=8):
    """Two decodes then a 5-token prefill chunk over fp8 caches, with the step's K/V still to be written."""
    g = torch.Generator().manual_seed(seed)
    seq_lens, q_lens = [20, 37, 12], [1, 1, 5]
    contexts = [tuple(torch.randn(n, 2, 64, generator=g) for _ in range(2)) for n in seq_lens]
    k_cache, v_cache, tables = make_paged_kv(contexts, 16, generator=g)
    md = build_metadata(q_lens, seq_lens, tables, 16, num_decodes=2)
    key = torch.cat([k[-q:] for (k, _), q in zip(contexts, q_lens)])  # [T, Hkv, D]
    value = torch.cat([v[-q:] for (_, v), q in zip(contexts, q_lens)])
    query = torch.randn(key.shape[0], 8, 64, generator=g)
    return query, key, value, quantize_kv(k_cache, K_SCALE), quantize_kv(v_cache, V_SCALE), (k_cache, v_cache), md


def _forward_reference(query, key, value, k8, v8, md):
    """The step through the plain torch path on caches written by the torch writer and dequantized to float32."""
    k8, v8 = k8.clone(), v8.clone()
    write_kv_cache_ref(key, value, k8, v8, md.slot_mapping, k_scale=K_SCALE, v_scale=V_SCALE)
    kd, vd = dequantize_kv(k8, K_SCALE, torch.float32), dequantize_kv(v8, V_SCALE, torch.float32)
    out = torch.empty_like(query)
    out[:2] = paged_attention_decode_ref(query[:2], kd, vd, md.block_tables[:2], md.seq_lens[:2], 0.125)
    out[2:] = paged_prefill_attention_ref(
        query, kd, vd, md.block_tables[2:], md.query_start_loc[2:], md.seq_lens[2:], 0.125
    )[2:]
    return out, k8, v8


def test_attention_forward_triton_fp8(triton_kernels, device):
    query, key, value, k8, v8, full, md = _mixed_step()
    want, want_k, want_v = _forward_reference(query, key, value, k8, v8, md)
    q2, key2, value2, k2, v2 = to_device(device, query, key, value, k8, v8)
    out = triton_kernels.attention.attention_forward_triton(
        q2, key2, value2, k2, v2, metadata_to(md, device), 0.125, k_scale=K_SCALE, v_scale=V_SCALE
    ).cpu()
    assert torch.equal(_bytes(k2.cpu()), _bytes(want_k)) and torch.equal(_bytes(v2.cpu()), _bytes(want_v))
    torch.testing.assert_close(out, want, **kernel_tol(device, torch.float32))


# --- the C++ CPU decode kernel -------------------------------------------------------------------------------------


@needs_cpp
@pytest.mark.parametrize(
    "ratio,head_dim,block_size", [(1, 64, 16), (4, 64, 16), (7, 128, 16), (2, 80, 32), (3, 256, 8)]
)
def test_cpu_decode_fp8(ratio, head_dim, block_size):
    seq_lens = [1, block_size + 3, 3 * block_size + 7, 300]
    query, full, fp8, deq, tables, lens = _case(seq_lens, ratio, head_dim, block_size, seed=9)
    scale = head_dim**-0.5
    out = paged_attention_decode_cpu(query, *fp8, tables, lens, scale, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(out, paged_attention_decode_ref(query, *deq, tables, lens, scale), **TIGHT)
    torch.testing.assert_close(out, paged_attention_decode_ref(query, *full, tables, lens, scale), **LOOSE)


@needs_cpp
def test_cpu_decode_fp8_bf16_query():
    query, _, fp8, deq, tables, lens = _case([3, 45, 130], 4, 128, dtype=torch.bfloat16, seed=10)
    out = paged_attention_decode_cpu(query, *fp8, tables, lens, 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    assert out.dtype == torch.bfloat16
    want = paged_attention_decode_ref(query.float(), *deq, tables, lens, 0.125)
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)  # one rounding of the output to bf16


@needs_cpp
def test_cpu_decode_reads_every_e4m3_code_exactly():
    # one position per sequence: the output is that position's value row times v_scale, i.e. its decoded bytes;
    # 256 codes as a head dim of 256 (subnormals, both zeros, +-448 and the two NaN codes)
    v8 = torch.arange(256, dtype=torch.uint8).view(FP8_KV_DTYPE).view(1, 1, 1, 256)
    k8 = torch.zeros_like(v8)
    out = paged_attention_decode_cpu(
        torch.randn(1, 1, 256),
        k8,
        v8,
        torch.zeros(1, 1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
        0.1,
        k_scale=1.0,
        v_scale=0.5,
    )
    want = v8.float().view(1, 1, 256) * 0.5
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out[~out.isnan()], want[~want.isnan()])


@needs_cpp
def test_cpu_step_writes_like_torch_and_attends():
    query, key, value, k8, v8, _, md = _mixed_step(seed=11)
    want, want_k, want_v = _forward_reference(query, key, value, k8, v8, md)
    rows, row_seqs, row_lens = cpu_decode.kernel_rows(md.query_start_loc_cpu, md.seq_lens_cpu, md.num_decodes)
    out = torch.empty_like(query)
    attention_step_cpu(
        query,
        key,
        value,
        k8,
        v8,
        md.slot_mapping,
        md.block_tables,
        row_lens,
        rows,
        0.125,
        out,
        row_seqs,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )
    assert torch.equal(_bytes(k8), _bytes(want_k)) and torch.equal(_bytes(v8), _bytes(want_v))
    torch.testing.assert_close(out, want, **TIGHT)


@pytest.mark.parametrize("kernel", ["1", "0"])
def test_attention_forward_ref_fp8_with_and_without_the_kernel(monkeypatch, kernel):
    if kernel == "1" and cpu_decode_kernel() is None:
        pytest.skip("no C++ toolchain for the CPU decode kernel")
    monkeypatch.setenv(cpu_decode.DISABLE_ENV, kernel)
    calls = []
    real = attention_ref.attend_rows
    monkeypatch.setattr(attention_ref, "attend_rows", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    query, key, value, k8, v8, (k_full, v_full), md = _mixed_step(seed=12)
    want, want_k, want_v = _forward_reference(query, key, value, k8, v8, md)
    out = attention_forward_ref(query, key, value, k8, v8, md, 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    assert len(calls) == (1 if kernel == "1" else 0)
    assert torch.equal(_bytes(k8), _bytes(want_k)) and torch.equal(_bytes(v8), _bytes(want_v))
    torch.testing.assert_close(out, want, **TIGHT)
    unquantized = attention_forward_ref(query, key, value, k_full, v_full, md, 0.125)
    torch.testing.assert_close(out, unquantized, **LOOSE)
