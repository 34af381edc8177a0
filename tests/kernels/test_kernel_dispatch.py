"""Backend selection and the dispatching entry points of vlserve.kernels."""

from __future__ import annotations

import warnings

import pytest
import torch
from _kernel_testutils import build_metadata, kernel_tol, make_paged_kv, metadata_to, to_device

import vlserve.kernels as K


def test_backend_selection(monkeypatch):
    monkeypatch.delenv(K.BACKEND_ENV, raising=False)
    assert K.get_attention_backend("cpu") == "torch"
    assert K.get_attention_backend(torch.device("cuda", 0)) == "triton"
    assert K.get_attention_backend() == ("triton" if torch.cuda.is_available() else "torch")
    monkeypatch.setenv(K.BACKEND_ENV, "triton")
    assert K.get_attention_backend("cpu") == "triton"
    monkeypatch.setenv(K.BACKEND_ENV, "TORCH")
    assert K.get_attention_backend("cuda") == "torch"
    monkeypatch.setenv(K.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="VLSERVE_ATTENTION_BACKEND"):
        K.get_attention_backend("cpu")


def test_forced_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv(K.BACKEND_ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.zeros(1, 2, 64)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        K.apply_rotary(q, q.clone(), torch.zeros(1, dtype=torch.long), torch.ones(4, 32), torch.zeros(4, 32))


def test_interpreter_on_cuda_warns_once(monkeypatch):
    # the dispatcher warns (once per process) when CUDA tensors meet an interpreter-enabled environment;
    # no real kernel module is imported here
    monkeypatch.delenv(K.BACKEND_ENV, raising=False)
    monkeypatch.setattr(K, "_triton_impl", lambda name: K._REF_IMPLS[name])
    K._warn_if_interpreter_on_cuda.cache_clear()
    try:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        with pytest.warns(RuntimeWarning, match="TRITON_INTERPRET is set while the Triton kernels run on CUDA"):
            K._impl("apply_rotary", torch.device("cuda", 0))
        K._warn_if_interpreter_on_cuda.cache_clear()
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert K._impl("apply_rotary", torch.device("cuda", 0)) is K._REF_IMPLS["apply_rotary"]
    finally:
        K._warn_if_interpreter_on_cuda.cache_clear()


def _step(seed=0):
    g = torch.Generator().manual_seed(seed)
    block_size, hkv, hq, d = 16, 1, 4, 64
    seqs = [(9, 1), (0, 6), (17, 3)]  # (prefix, q_len); first is a decode
    prefixes = [(torch.randn(max(p, 1), hkv, d, generator=g),) * 2 for p, _ in seqs]
    k_cache, v_cache, tables = make_paged_kv(prefixes, block_size, generator=g)
    md = build_metadata([q for _, q in seqs], [p + q for p, q in seqs], tables, block_size, num_decodes=1)
    t = md.query_start_loc_cpu[-1]
    qkv = [torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv)]
    positions = torch.tensor([p + i for p, q in seqs for i in range(q)])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = K.build_rotary_cache(inv_freq, 64)
    return qkv, k_cache, v_cache, md, positions, cos, sin


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dispatch_full_step(monkeypatch, request, device, backend):
    # rotary + attention_forward through the dispatching names on the test device, against the
    # reference functions on CPU
    (q, k, v), k_cache, v_cache, md, positions, cos, sin = _step()
    q_ref, k_ref, kc_ref, vc_ref = q.clone(), k.clone(), k_cache.clone(), v_cache.clone()
    K.apply_rotary_ref(q_ref, k_ref, positions, cos, sin)
    expected = K.attention_forward_ref(q_ref, k_ref, v, kc_ref, vc_ref, md, 0.125)

    if backend == "triton":
        request.getfixturevalue("triton_dispatch")  # on CPU: the interpreted kernels, for this test only
    monkeypatch.setenv(K.BACKEND_ENV, backend)
    q, k, v, k_cache, v_cache, positions, cos, sin = to_device(device, q, k, v, k_cache, v_cache, positions, cos, sin)
    md = metadata_to(md, device)
    tol = kernel_tol(device, torch.float32)
    K.apply_rotary(q, k, positions, cos, sin)
    out = K.attention_forward(q, k, v, k_cache, v_cache, md, 0.125)
    assert out.device.type == device.type
    torch.testing.assert_close(out.cpu(), expected, **tol)
    torch.testing.assert_close(k_cache.cpu(), kc_ref, atol=1e-6 if device.type == "cpu" else 1e-5, rtol=0)
    # the standalone entry points agree with attention_forward on the decode and prefill parts
    dec = K.paged_attention_decode(q[:1], k_cache, v_cache, md.block_tables[:1], md.seq_lens[:1], 0.125)
    torch.testing.assert_close(dec, out[:1], **tol)
    pre = K.paged_prefill_attention(
        q, k_cache, v_cache, md.block_tables[1:], md.query_start_loc[1:], md.seq_lens[1:], 0.125
    )
    torch.testing.assert_close(pre[1:], out[1:], **tol)
    k_cache2 = k_cache.clone()
    K.write_kv_cache(k, v, k_cache2, v_cache.clone(), md.slot_mapping)
    assert torch.equal(k_cache2, k_cache)


@pytest.mark.slow
def test_triton_kernels_compile_for_sm90():
    # Lowers every kernel to a cubin for an H100-class target; catches GPU-only compile errors
    # (tl.dot shapes, dtypes) that the CPU interpreter does not check. Needs no GPU.
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels._triton_aot_check"],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 15
