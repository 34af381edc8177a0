"""The mixture-of-experts FFN: the torch twin (`fused_moe_ref`) against a per-token loop, and the Triton kernel
(`triton_fused_moe`) against the twin.

Triton: on CPU an interpreted copy (imported inside a TRITON_INTERPRET=1 window, as test_triton_wna16.py does), on a
GPU the compiled one. Tolerances, relative to the largest |reference| of a case: float32 1e-4 absolute (ieee
`tl.dot`; only the summation order differs), 16-bit 2e-2 (x, gate_up and hidden are rounded to the 16-bit dtype
between the GEMMs, and the interpreter truncates float32 -> bf16 where a GPU rounds to nearest).
"""

from __future__ import annotations

import importlib
import textwrap

import pytest
import torch
from _interpreted import interpreted_module, run_aot_script

from vlserve.kernels.activation import activation
from vlserve.kernels.fused_moe_ref import fused_moe_ref, route_topk

MODULE = "vlserve.kernels.triton_fused_moe"
H = 64


def _interpreted_moe():
    return interpreted_module(MODULE)


@pytest.fixture(scope="module")
def moe(device):
    """triton_fused_moe for the test device: compiled on CUDA, an interpreted copy on CPU."""
    return importlib.import_module(MODULE) if device.type == "cuda" else _interpreted_moe()


def _case(t, e, k, inter, dtype=torch.float32, offset=0, num_global=None, seed=0, hidden=H):
    # x [T, H], w13 [E, 2I, H], w2 [E, H, I]; ids / weights [T, k] routed over num_global experts, the local ones
    # [offset, offset + E) favoured so that most (not all) choices land on this rank
    g = torch.Generator().manual_seed(seed)
    num_global = num_global or e
    x = torch.randn(t, hidden, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(e, hidden, inter, generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(t, num_global, generator=g)
    logits[:, offset : offset + e] += 1.0
    weights, ids = route_topk(logits, k, renormalize=False)  # weights < 1, also for k = 1
    return x, w13, w2, weights, ids


def _naive(x, w13, w2, weights, ids, act_name="silu", offset=0):
    # the definition, one (token, choice) at a time in float64
    act = activation(act_name)
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - offset
            if not 0 <= e < num_experts:
                continue
            w = w13[e].double()
            hidden = act(w[:inter] @ x[t].double()) * (w[inter:] @ x[t].double())  # [I]
            out[t] += float(weights[t, j]) * (w2[e].double() @ hidden)
    return out.to(x.dtype)


def _check(out, ref32, dtype):
    assert out.dtype == dtype and out.shape == ref32.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), ref32, atol=1e-4, rtol=1e-4)
    else:
        tol = 2e-2 * max(ref32.abs().max().item(), 1e-3)
        torch.testing.assert_close(out.float().cpu(), ref32, atol=tol, rtol=2e-2)


def _run(moe, device, x, w13, w2, weights, ids, act_name="silu", offset=0, **kw):
    return moe.fused_moe_triton(*(a.to(device) for a in (x, w13, w2, weights, ids)), act_name, offset, **kw)


def _ref32(x, w13, w2, weights, ids, act_name="silu", offset=0):
    return fused_moe_ref(x.float(), w13.float(), w2.float(), weights.float(), ids, act_name, offset)


# ------------------------------------------------------------------------------------------ the torch reference


@pytest.mark.parametrize(
    "t,e,k,offset,num_global", [(1, 4, 1, 0, 4), (1, 4, 2, 2, 8), (7, 4, 2, 0, 4), (9, 4, 2, 3, 12), (33, 8, 3, 4, 16)]
)
@pytest.mark.parametrize("act_name", ["silu", "gelu"])
def test_reference_matches_naive(t, e, k, offset, num_global, act_name):
    x, w13, w2, weights, ids = _case(t, e, k, 24, offset=offset, num_global=num_global, seed=t * 10 + k)
    out = fused_moe_ref(x, w13, w2, weights, ids, act_name, offset)
    torch.testing.assert_close(out, _naive(x, w13, w2, weights, ids, act_name, offset), atol=1e-5, rtol=1e-5)


def test_reference_edge_routing():
    # local experts [2, 6): ids below and above the range, expert 4 (local 2) chosen by nobody, a token with none
    x, w13, w2, _, _ = _case(5, 4, 2, 16)
    ids = torch.tensor([[2, 7], [0, 5], [3, 2], [1, 9], [5, 3]])
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(1))
    out = fused_moe_ref(x, w13, w2, weights, ids, "silu", 2)
    torch.testing.assert_close(out, _naive(x, w13, w2, weights, ids, "silu", 2), atol=1e-5, rtol=1e-5)
    assert out[3].abs().max() == 0 and out[[0, 1, 2, 4]].abs().amin(dim=1).gt(0).all()
    w13_no4 = w13.clone()
    w13_no4[2] = float("nan")  # the unused expert's weights are never touched
    torch.testing.assert_close(fused_moe_ref(x, w13_no4, w2, weights, ids, "silu", 2), out)
    empty = fused_moe_ref(x[:0], w13, w2, weights[:0], ids[:0], "silu", 2)
    assert empty.shape == (0, H)
    assert fused_moe_ref(x, w13, w2, weights, ids + 20, "silu", 2).abs().max() == 0


# ------------------------------------------------------------------------------------------ alignment


def test_align_layout():
    moe = _interpreted_moe()
    # local experts [1, 5): pairs 0 (id 5) and 3 (id 9) are not local; expert 0 has pairs 1, 2, 5; expert 1 pair 4
    sorted_ids, block_expert, num_valid = moe.moe_align_block_size(torch.tensor([[5, 1], [1, 9], [2, 1]]), 4, 4, 1)
    assert sorted_ids.tolist() == [1, 2, 5, 6, 4, 6, 6, 6] + [6] * 12  # S_max = 6 + 4 * 3 rounded up to 20
    assert block_expert.tolist() == [0, 1, 4, 4, 4] and num_valid.tolist() == [8]
    assert sorted_ids.dtype == block_expert.dtype == num_valid.dtype == torch.int32


@pytest.mark.parametrize(
    "t,e,k,block_m,offset,num_global",
    [(1, 8, 2, 16, 0, 8), (33, 8, 2, 16, 2, 12), (50, 4, 3, 32, 0, 16), (7, 64, 4, 16, 0, 64)],
)
def test_align_invariants(t, e, k, block_m, offset, num_global):
    moe = _interpreted_moe()
    ids = _case(t, e, k, 16, offset=offset, num_global=num_global, seed=t + e)[4]
    sorted_ids, block_expert, num_valid = moe.moe_align_block_size(ids, e, block_m, offset)
    local = (ids.reshape(-1) - offset).tolist()
    pairs = [p for p, le in enumerate(local) if 0 <= le < e]
    valid = int(num_valid)
    assert sorted_ids.numel() % block_m == 0 and valid % block_m == 0 and valid <= sorted_ids.numel()
    assert block_expert.numel() == sorted_ids.numel() // block_m
    used = [p for p in sorted_ids[:valid].tolist() if p != t * k]
    assert sorted(used) == pairs and (sorted_ids[valid:] == t * k).all()  # each local pair exactly once
    for b in range(block_expert.numel()):
        rows = [p for p in sorted_ids[b * block_m : (b + 1) * block_m].tolist() if p != t * k]
        if b * block_m >= valid:
            assert block_expert[b] == e and not rows
        else:
            assert rows and all(local[p] == block_expert[b] for p in rows)  # no empty block, one expert a block
    assert block_expert[: valid // block_m].diff().ge(0).all()  # runs in expert order


# ------------------------------------------------------------------------------------------ the Triton kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [48, 96])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("e,offset,num_global", [(4, 3, 12), (8, 0, 8)])
@pytest.mark.parametrize("t", [1, 5, 33])
def test_triton_matches_reference(moe, device, t, e, offset, num_global, k, inter, dtype):
    # N = 2I = 96 / 192 and K = I = 48 / 96 against BLOCK_N = 64, BLOCK_K = 32: partial N and K tiles
    case = _case(t, e, k, inter, dtype, offset, num_global, seed=t * 100 + e * 10 + k)
    out = _run(moe, device, *case, offset=offset)
    _check(out, _ref32(*case, offset=offset), dtype)


@pytest.mark.parametrize(
    "dtype,act_name,config",
    [
        (torch.float16, "silu", None),
        (torch.float32, "gelu", None),
        (torch.bfloat16, "gelu_pytorch_tanh", None),
        (torch.float32, "silu", dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)),
        (torch.bfloat16, "silu", dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=1)),
    ],
)
def test_triton_dtypes_activations_tiles(moe, device, dtype, act_name, config):
    case = _case(21, 4, 2, 40, dtype, offset=2, num_global=8, seed=7)
    out = _run(moe, device, *case, act_name, offset=2, config=config)
    _check(out, _ref32(*case, act_name, offset=2), dtype)


def test_triton_one_busy_expert(moe, device):
    # every token on local expert 1 (3 M-blocks of one expert), the others empty; k = 2 with the second choice
    # elsewhere (global id 0, not on this rank)
    x, w13, w2, weights, _ = _case(40, 4, 2, 48, seed=3)
    ids = torch.tensor([[2, 0]] * 40)
    out = _run(moe, device, x, w13, w2, weights, ids, offset=1)
    _check(out, _ref32(x, w13, w2, weights, ids, offset=1), torch.float32)


def test_triton_empty_inputs(moe, device):
    x, w13, w2, weights, ids = _case(5, 4, 2, 48)
    out = _run(moe, device, x[:0], w13, w2, weights[:0], ids[:0])
    assert out.shape == (0, H) and out.dtype == x.dtype
    nobody = _run(moe, device, x, w13, w2, weights, ids + 4)  # all ids on another rank
    assert nobody.shape == x.shape and nobody.abs().max() == 0
    with pytest.raises(ValueError):
        _run(moe, device, x, w13, w2, weights, ids, "no_such_act")


def test_dispatch_reaches_triton(device, monkeypatch):
    # kernels.fused_moe with the triton backend forced runs this module (on CPU: its interpreted copy)
    import vlserve.kernels as K

    impl = (
        importlib.import_module(MODULE).fused_moe_triton
        if device.type == "cuda"
        else _interpreted_moe().fused_moe_triton
    )
    calls = []
    monkeypatch.setenv(K.BACKEND_ENV, "triton")
    monkeypatch.setattr(K, "_triton_impl", lambda name: (calls.append(name), impl)[1])
    monkeypatch.setattr(K, "_interpreter_enabled", lambda: True)
    case = _case(5, 4, 2, 48, offset=1, num_global=6)
    out = K.fused_moe(*(a.to(device) for a in case), "silu", 1)
    assert calls == ["fused_moe"]
    _check(out, _ref32(*case, offset=1), torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("t", [300])
def test_triton_bigger(moe, device, t):
    # prefill-sized: 600 pairs over 8 of 16 experts, H = 128, several M-blocks per expert
    case = _case(t, 8, 2, 96, torch.bfloat16, offset=8, num_global=16, seed=11, hidden=128)
    cfg = (
        None
        if device.type == "cuda"
        else dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=1)
    )
    _check(_run(moe, device, *case, offset=8, config=cfg), _ref32(*case, offset=8), torch.bfloat16)


AOT_SCRIPT = textwrap.dedent("""
    import os
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vlserve.kernels import triton_fused_moe as M

    def compile(dt, gather, cfg):
        fn = M._moe_gemm_kernel
        types = dict(a_ptr="*" + dt, w_ptr="*" + dt, out_ptr="*" + (dt if gather else "fp32"),
                     sorted_ids_ptr="*i32", block_expert_ptr="*i32", num_valid_ptr="*i32", weights_ptr="*fp32")
        consts = dict(GATHER_A=gather, MUL_ROUTED_WEIGHT=not gather, UPCAST=False, FP32_DOT=dt == "fp32",
                      **{k: v for k, v in cfg.items() if k.isupper()})
        sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
        k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
        assert k.metadata.shared <= 232448, (cfg, k.metadata.shared)
        print("ok", dt, gather, cfg, k.metadata.shared, flush=True)

    cfgs = [M.moe_config(s, 8) for s in (8, 400, 4000)]
    for cfg in cfgs:
        for gather in (True, False):
            compile("bf16", gather, cfg)
    compile("fp16", True, cfgs[1])
    compile("fp32", False, cfgs[0])
""")


@pytest.mark.slow
def test_moe_kernel_compiles_for_sm90():
    # lowers the kernel (each GPU tile of moe_config, both launches, three dtypes) to an sm_90 cubin: the GPU-only
    # checks the interpreter skips (tl.dot operand layouts, shared memory). Needs no GPU.
    stdout = run_aot_script(AOT_SCRIPT)
    assert stdout.count("ok ") == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_cpu_experts_match_the_reference(dtype):
    """FusedExperts packed for the CPU linear kernel (SiLU fused into the first pass) against the torch twin."""
    from vlserve.kernels.cpu_linear import cpu_linear_kernel
    from vlserve.models.moe import FusedExperts

    if cpu_linear_kernel() is None:
        pytest.skip("the CPU linear kernel is not built here")
    torch.manual_seed(0)
    experts = FusedExperts(num_experts=6, hidden_size=64, intermediate_size=64).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    x = torch.randn(9, 64).to(dtype)
    weights = torch.softmax(torch.randn(9, 2), -1).to(dtype)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(9)])  # [9, 2]
    want = fused_moe_ref(x, experts.gate_up_proj.data, experts.down_proj.data, weights, ids)
    assert experts.pack_for_cpu() and experts.gate_up_proj is None
    got = experts(x, weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
