"""The GPU routes of the quantized linear layers against `quant_linear`'s float32 references.

WNA16 Triton kernel (`triton_wna16`): on CPU an interpreted copy (imported inside a TRITON_INTERPRET=1 window, as
tests/kernels/_interpreted.py does for the other kernels), on a GPU the compiled one. Tolerances, relative to the
largest |reference| of the case (`_check`, also as rtol): float32 inputs 2e-5 (fp32 `tl.dot` at ieee precision: only
the summation order differs; seen: 4e-7), 16-bit inputs 1.5e-2 (the dequantized tile is rounded to x.dtype before
the dot and the output after it; Triton's interpreter casts float32 to bf16 by truncating, up to 2^-7 relative,
where a GPU rounds to nearest; seen: 9e-3 for bf16 here).
INT8 / FP8 tolerances are in `_int8_check` / `_fp8_check`.

`quant_linear_cuda` (`_int_mm`, `_scaled_mm`): the CUDA tests skip without a GPU; the `*_cpu` ones run the same
functions with torch's CPU `_int_mm` / `_scaled_mm` (the FP8 capability check patched to sm90), which checks the
quantization, padding, scale shapes and rescaling, not cuBLAS's constraints.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from _interpreted import interpreted_module, run_aot_script

from vlserve.kernels import quant_linear as QL
from vlserve.kernels import quant_linear_cuda as QC

MODULE = "vlserve.kernels.triton_wna16"
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def _interpreted_wna16():
    return interpreted_module(MODULE)


@pytest.fixture(scope="module")
def wna16(device):
    """triton_wna16 for the test device: compiled on CUDA, an interpreted copy on CPU."""
    return importlib.import_module(MODULE) if device.type == "cuda" else _interpreted_wna16()


def _case(m, n, k, bits, group, dtype, scale_dtype=None, seed=0, shape=None):
    # canonical q [N, K], scales [N, G], zeros [N, G]; x [m, K] (or `shape`); bias [N]
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 2**bits, (n, k), generator=g).to(torch.uint8)
    scales = (torch.rand(n, groups, generator=g) * 0.02 + 0.005).to(scale_dtype or dtype)
    zeros = torch.randint(0, 2**bits, (n, groups), generator=g).to(torch.uint8)
    x = torch.randn(*(shape or (m,)), k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    return x, q, scales, zeros, bias


def _ref32(x, q, scales, zeros, group, bias):
    # float32 reference: dequantize, then matmul
    w = QL.dequantize_wna16_ref(q, scales, zeros, group)
    return F.linear(x.float(), w, None if bias is None else bias.float())


def _check(out, ref32, dtype):
    tol = 2e-5 if dtype == torch.float32 else 1.5e-2
    scale = ref32.abs().max().item()
    assert out.dtype == dtype and out.shape == ref32.shape
    torch.testing.assert_close(out.float().cpu(), ref32, atol=tol * scale, rtol=tol)


def _run(wna16, device, x, q, scales, zeros, group, bits, bias, **kw):
    qweight, s, z = wna16.pack_wna16_for_triton(q, scales, zeros, bits)
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    return wna16.wna16_matmul_triton(dev(x), dev(qweight), dev(s), dev(z), group, bits, dev(bias), **kw)


def test_pack_layout():
    wna16 = _interpreted_wna16()
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15, 9, 10]], dtype=torch.uint8)  # [N=1, K=10]
    qweight, s, z = wna16.pack_wna16_for_triton(q, torch.ones(1, 1), torch.zeros(1, 1), 4)
    assert qweight.shape == (2, 1) and qweight.dtype == torch.int32 and s.shape == z.shape == (1, 1)
    assert qweight[0, 0].item() == 0xF7654321 - 2**32 and qweight[1, 0].item() == 0xA9  # k 10..15 padded with 0
    q8 = torch.arange(8, dtype=torch.uint8).reshape(1, 8) * 30  # 0 .. 210
    w8, _, _ = wna16.pack_wna16_for_triton(q8, torch.ones(1, 1), torch.zeros(1, 1), 8)
    assert [hex(v & 0xFFFFFFFF) for v in w8[:, 0].tolist()] == ["0x5a3c1e00", "0xd2b49678"]
    with pytest.raises(ValueError):
        wna16.pack_wna16_for_triton(q8, torch.ones(1, 1), torch.zeros(1, 1), 4)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_wna16_matches_reference(wna16, device, bits, group, m, dtype, bias):
    # K = 2 groups + 40 columns (a partial last group; not a multiple of BLOCK_K = 64), N = 72 (not of BLOCK_N = 32)
    n, k = 72, 2 * group + 40
    x, q, scales, zeros, b = _case(m, n, k, bits, group, dtype, seed=bits * 1000 + group + m)
    b = b if bias else None
    cfg = wna16.WNA16Config(16 if m <= 16 else 32, 32, 64, 4, 1, 4)
    out = _run(wna16, device, x, q, scales, zeros, group, bits, b, config=cfg, split_k=1)
    _check(out, _ref32(x, q, scales, zeros, group, b), dtype)


@pytest.mark.parametrize(
    "bits,group,k,block_k,split,dtype,scale_dtype",
    [
        (4, 32, 100, 128, 1, torch.bfloat16, torch.float32),  # 4 groups a tile; K % 8 != 0 (padded word)
        (8, 48, 200, 64, 1, torch.float32, None),  # group not a power of two: per-column gather
        (4, 128, 700, 64, 3, torch.float16, None),  # split K: 3 float32 partial sums + bias, added by torch
        (8, 64, 520, 128, 2, torch.bfloat16, None),  # split K, 2 groups a tile
        (4, 520, 520, 64, 1, torch.float32, None),  # one group per channel (group = K)
    ],
)
def test_wna16_tiles_and_splits(wna16, device, bits, group, k, block_k, split, dtype, scale_dtype):
    x, q, scales, zeros, b = _case(0, 40, k, bits, group, dtype, scale_dtype, seed=k, shape=(2, 3))
    cfg = wna16.WNA16Config(16, 32, block_k, 4, 1, 2)
    out = _run(wna16, device, x, q, scales, zeros, group, bits, b, config=cfg, split_k=split)
    assert out.shape == (2, 3, 40)
    _check(out, _ref32(x, q, scales, zeros, group, b), dtype)


def test_wna16_every_autotune_config(wna16, device):
    # each candidate of the autotune list, as a fixed launch (the interpreter cannot time them)
    configs = list(dict.fromkeys(wna16.DECODE_CONFIGS + wna16.MID_CONFIGS + wna16.PREFILL_CONFIGS))
    x, q, scales, zeros, b = _case(40, 200, 320, 4, 64, torch.bfloat16, seed=7)
    ref = _ref32(x, q, scales, zeros, 64, b)
    for cfg in configs:
        _check(_run(wna16, device, x, q, scales, zeros, 64, 4, b, config=cfg, split_k=1), ref, torch.bfloat16)


def test_wna16_default_launch_and_buckets(wna16, device):
    assert [wna16.m_bucket(m) for m in (1, 16, 17, 33, 100, 128, 5000)] == [16, 16, 32, 64, 128, 128, 256]
    assert wna16.configs_for(1) == wna16.DECODE_CONFIGS and wna16.configs_for(2048) == wna16.PREFILL_CONFIGS
    tuned = [c for c in wna16._tuned_kernel.configs]
    kept = wna16._prune(tuned, {"m_bucket": 16})
    assert [c._wna16 for c in kept] == wna16.DECODE_CONFIGS
    x, q, scales, zeros, b = _case(3, 48, 128, 4, 32, torch.float32, seed=3)
    out = _run(wna16, device, x, q, scales, zeros, 32, 4, b)  # no config: default (tuned on CUDA)
    _check(out, _ref32(x, q, scales, zeros, 32, b), torch.float32)
    empty = _run(wna16, device, x[:0], q, scales, zeros, 32, 4, b)
    assert empty.shape == (0, 48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wna16_linear_cuda_act_order(wna16, device, dtype, monkeypatch):
    # quant_linear's prepare_wna16 (act order -> perm) then the Triton route, against its wna16_linear
    monkeypatch.setattr(QC, "_wna16_module", lambda: wna16)
    x, q, scales, zeros, b = _case(6, 64, 256, 4, 64, dtype, seed=11)
    g_idx = torch.randperm(256, generator=torch.Generator().manual_seed(1)) % 4
    w = QL.prepare_wna16(q, scales, zeros, 64, 4, g_idx)
    assert w.perm is not None
    ref = QL.wna16_linear(x.float(), QL.WNA16Weights(w.q, w.scales.float(), w.zeros, 64, 4, w.perm), b.float())
    packed = QC.prepare_wna16_cuda(w)
    packed = QC.TritonWNA16Weights(
        *(t.to(device) for t in (packed.qweight, packed.scales, packed.zeros)),
        packed.group_size,
        packed.bits,
        packed.perm.to(device),
    )
    _check(QC.wna16_linear_cuda(x.to(device), packed, b.to(device)), ref, dtype)


# ----------------------------------------------------------------------------------------------------- INT8, FP8


def _int8_case(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8)
    scale = torch.rand(n, generator=g) * 0.01 + 0.001
    return torch.randn(m, k, generator=g).to(dtype), weight, scale, torch.randn(n, generator=g).to(dtype)


def _int8_check(device, m, n, k, dtype):
    x, weight, scale, bias = _int8_case(m, n, k, dtype, seed=m + n)
    ref = QL.int8_linear_ref(x, weight, scale, bias)
    out = QC.int8_linear_cuda(x.to(device), weight.to(device), scale.to(device), bias.to(device))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.cpu(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (5, 40, 96), (33, 64, 128), (4, 36, 60)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_cuda_logic_on_cpu(m, n, k, dtype):
    assert QC.int8_path(m, k, n) == ("int_mm" if k % 8 == 0 and n % 8 == 0 else "float")
    _int8_check(torch.device("cpu"), m, n, k, dtype)


@needs_cuda
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (5, 40, 96), (33, 64, 128), (300, 256, 512), (4, 36, 60)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int8_linear_cuda(m, n, k, dtype):
    _int8_check(torch.device("cuda"), m, n, k, dtype)


def _fp8_case(m, n, k, dtype, kind, seed=0, block=(128, 128)):
    # kind: "tensor" / "channel" / "block" weight scales
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    if kind == "tensor":
        scale, block = torch.tensor(0.002), None
    elif kind == "channel":
        scale, block = torch.rand(n, generator=g) * 0.004 + 0.001, None
    else:
        scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 0.004 + 0.001
    x = torch.randn(m, k, generator=g).to(dtype)
    return x, weight, scale, block, torch.randn(n, generator=g).to(dtype)


FP8_CASES = [  # (kind, act, act_group, route on an sm90 GPU with CUDA >= 12.9)
    ("tensor", "static", 0, "tensorwise"),
    ("tensor", "token", 0, "rowwise"),
    ("channel", "token", 0, "rowwise"),
    ("channel", "static", 0, "rowwise"),
    ("channel", "group", 64, "dequant"),
    ("block", "group", 128, "blockwise"),
    ("block", "token", 0, "dequant"),
]


def _fp8_check(device, m, n, k, dtype, kind, act, act_group, with_bias=True, block=(128, 128)):
    x, weight, scale, block, bias = _fp8_case(m, n, k, dtype, kind, seed=m + k, block=block)
    input_scale = x.float().abs().max() / 448 * 1.5 if act == "static" else None
    bias = bias if with_bias else None
    w = QL.prepare_fp8(weight, scale, block, act, act_group, input_scale)
    ref = QL.fp8_linear_ref(x, w, bias)
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    path = QC.fp8_path(dev(x), weight, scale, block, act, act_group)
    out = QC.fp8_linear_cuda(dev(x), dev(w.weight), dev(w.scale), block, act, act_group, dev(w.input_scale), dev(bias))
    tol = 2e-2  # the route's output passes through bf16 (row-wise) or x.dtype
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float().cpu(), ref.float(), atol=tol * ref.abs().max().item(), rtol=tol)
    return path


@pytest.mark.parametrize("kind,act,act_group,route", FP8_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_cuda_logic_on_cpu(kind, act, act_group, route, dtype, monkeypatch):
    # torch's CPU _scaled_mm stands in for cuBLAS (the capability check says sm90 with CUDA 12.9). It has no
    # blockwise kernel: that route raises on CPU, which exercises the switch to the dequantizing fallback.
    monkeypatch.setattr(QC, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(QC, "_cuda_version", lambda: (12, 9))
    monkeypatch.setattr(QC, "_blockwise_failed", False)
    for m in (1, 5, 33):
        if route == "blockwise" and not QC._blockwise_failed:
            with pytest.warns(UserWarning, match="blockwise scaled_mm failed"):
                path = _fp8_check(torch.device("cpu"), m, 384, 256, dtype, kind, act, act_group)
            assert path == route and QC._blockwise_failed
        else:
            path = _fp8_check(torch.device("cpu"), m, 384, 256, dtype, kind, act, act_group, with_bias=m != 5)
            assert path == (route if route != "blockwise" else "dequant")
    monkeypatch.setattr(QC, "_blockwise_failed", False)
    monkeypatch.setattr(QC, "_capability", lambda device: (8, 9))  # Ada: no blockwise; K or N % 16: no _scaled_mm
    assert _fp8_check(torch.device("cpu"), 5, 384, 256, dtype, kind, act, act_group) == (
        "dequant" if route == "blockwise" else route
    )
    assert (
        _fp8_check(torch.device("cpu"), 5, 40, 72, dtype, kind, act, 8 if act == "group" else 0, block=(16, 24))
        == "dequant"
    )
    monkeypatch.setattr(QC, "_capability", lambda device: None)  # CPU as it is: everything dequantizes
    assert _fp8_check(torch.device("cpu"), 5, 384, 256, dtype, kind, act, act_group) == "dequant"


@needs_cuda
@pytest.mark.parametrize("kind,act,act_group,route", FP8_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 33, 300])
def test_fp8_linear_cuda(kind, act, act_group, route, dtype, m):
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        pytest.skip("FP8 GEMMs need sm89+")
    path = _fp8_check(torch.device("cuda"), m, 384, 256, dtype, kind, act, act_group)
    if route != "blockwise" or (cap[0] == 9 and QC._cuda_version() >= (12, 9)):
        assert path == route and not QC._blockwise_failed, "the blockwise scaled_mm raised and was switched off"


# ----------------------------------------------------------------------------------------------------- build checks


def test_quant_linear_cuda_imports_without_triton():
    code = "import sys, vlserve.kernels.quant_linear_cuda; assert 'triton' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


AOT_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vlserve.kernels import triton_wna16 as T

    def compile(dt, bits, group, split, cfg, fp32=False):
        fn = T._wna16_kernel
        types = dict(x_ptr="*" + dt, qw_ptr="*i32", s_ptr="*" + dt, z_ptr="*u8", bias_ptr="*" + dt,
                     out_ptr="*fp32" if split > 1 else "*" + dt)
        consts = dict(GROUP_SIZE=group, BITS=bits, HAS_BIAS=split == 1, SPLIT_K=split, UPCAST=False,
                      FP32_DOT=fp32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      GROUP_M=cfg.group_m)
        sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
        k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        assert k.metadata.shared <= 232448, (cfg, k.metadata.shared)
        print("ok", dt, bits, group, split, cfg, k.metadata.shared, flush=True)

    for cfg in dict.fromkeys(T.DECODE_CONFIGS + T.MID_CONFIGS + T.PREFILL_CONFIGS):
        compile("bf16", 4, 128, 1, cfg)
    compile("fp16", 8, 32, 2, T.DECODE_CONFIGS[0])
    compile("bf16", 4, 32, 1, T.PREFILL_CONFIGS[1])
    compile("fp32", 4, 64, 1, T.MID_CONFIGS[1], fp32=True)
    compile("bf16", 8, 48, 1, T.DECODE_CONFIGS[0])
""")


@pytest.mark.slow
def test_wna16_kernel_compiles_for_sm90():
    # lowers the kernel (every autotune candidate, both bit widths, all three group-row modes) to an sm_90 cubin:
    # the GPU-only checks the interpreter skips (tl.dot operand layouts, reshape, shared memory). Needs no GPU.
    stdout = run_aot_script(AOT_SCRIPT)
    w = _interpreted_wna16()
    candidates = dict.fromkeys(w.DECODE_CONFIGS + w.MID_CONFIGS + w.PREFILL_CONFIGS)
    assert stdout.count("ok ") == len(candidates) + 4
