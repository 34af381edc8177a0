"""`cpu_linear_silu_mul(..., pre_act_add=)`: a float32 [M, 2I] addend joins the packed kernel's gate and up sums
before the activation. A zero addend (or zero rows of it) gives bit-identical output to the call without it; a
nonzero one matches the unfused `silu(gate + dg) * (up + du)` in float32; a LoRA gate_up delta from the C++ LoRA
kernel through it matches the unfused LoRA MLP. Run on every code path this machine can run (the `isa` fixture)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlserve.kernels.cpu_linear import cpu_linear_kernel, cpu_linear_silu_mul, pack_linear_weight

pytestmark = pytest.mark.skipif(cpu_linear_kernel() is None, reason="no AVX2 + FMA or AVX-512 here (or no toolchain)")
DTYPES = [torch.float32, torch.bfloat16]


def _operands(m, i, k, bias, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(2 * i, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(2 * i, generator=g).to(dtype) if bias else None
    add = torch.randn(m, 2 * i, generator=g) * 0.5
    return x, w, b, add


def _unfused(x, w, b, add, i):
    """silu(gate + dg) * (up + du) in float64 from the operands as given."""
    gate_up = x.double() @ w.double().T + (0 if b is None else b.double()) + add.double()  # [M, 2I]
    return F.silu(gate_up[:, :i]) * gate_up[:, i:]


# rows below, at and past the register blocks and row chunks; I of one and several panels; K past one K block
@pytest.mark.parametrize("m", [1, 2, 5, 8, 13, 130])
@pytest.mark.parametrize("i,k", [(32, 64), (96, 300), (256, 512)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_add_is_bit_identical(m, i, k, bias, dtype, isa):
    x, w, b, _ = _operands(m, i, k, bias, dtype)
    packed = pack_linear_weight(w)
    plain = cpu_linear_silu_mul(x, packed, b, i)
    assert torch.equal(cpu_linear_silu_mul(x, packed, b, i, torch.zeros(m, 2 * i)), plain)
    assert torch.equal(cpu_linear_silu_mul(x, packed, b, i, None), plain)


@pytest.mark.parametrize("m", [1, 3, 7, 13, 70])
@pytest.mark.parametrize("i,k", [(32, 64), (96, 300), (256, 512)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nonzero_add_matches_the_unfused_reference(m, i, k, bias, dtype, isa):
    x, w, b, add = _operands(m, i, k, bias, dtype)
    zero_rows = torch.arange(m) % 3 == 1  # rows of the base model among adapter rows
    add[zero_rows] = 0
    packed = pack_linear_weight(w)
    got = cpu_linear_silu_mul(x, packed, b, i, add)
    assert got.shape == (m, i) and got.dtype == dtype
    assert torch.equal(got[zero_rows], cpu_linear_silu_mul(x, packed, b, i)[zero_rows])
    exact = _unfused(x, w, b, add, i)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
    else:  # gate, up, silu and the product each rounded to bf16 once, as the kernel without the add rounds them
        torch.testing.assert_close(got.double(), exact, rtol=2e-2, atol=2e-2)


def test_strided_add_and_leading_dims(isa):
    x, w, b, add = _operands(6, 64, 128, True, torch.float32)
    packed = pack_linear_weight(w)
    wide = torch.zeros(6, 200)
    wide[:, 10:138] = add
    got = cpu_linear_silu_mul(x.view(2, 3, 128), packed, b, 64, wide[:, 10:138].reshape(2, 3, 128))
    assert got.shape == (2, 3, 64)
    torch.testing.assert_close(got.view(6, 64), cpu_linear_silu_mul(x, packed, b, 64, add), rtol=0, atol=0)


def test_bad_add_is_refused(isa):
    x, w, b, add = _operands(4, 32, 64, False, torch.bfloat16)
    packed = pack_linear_weight(w)
    with pytest.raises(ValueError, match="pre_act_add"):
        cpu_linear_silu_mul(x, packed, b, 32, add.bfloat16())  # float32 only
    with pytest.raises(ValueError, match="pre_act_add"):
        cpu_linear_silu_mul(x, packed, b, 32, add[:, :32])


def test_lora_gate_up_delta_through_the_fused_mlp(isa):
    """The MLP path the LoRA layer can take: the C++ LoRA kernel writes the gate_up delta into a zeroed float32
    buffer, the fused kernel adds it before the activation; equal to the unfused LoRA MLP, base rows bit-identical."""
    from vlserve.kernels.lora_cpu import LoRAStack, lora_add_cpu, lora_cpu_kernel
    from vlserve.kernels.lora_ref import add_lora_grouped, token_groups

    if lora_cpu_kernel() is None:
        pytest.skip("no C++ toolchain for the LoRA kernel")
    m, i, k, slots_n, rank = 11, 96, 256, 3, 8
    x, w, b, _ = _operands(m, i, k, True, torch.float32)
    g = torch.Generator().manual_seed(5)
    lora_a = [torch.randn(slots_n, rank, k, generator=g) / k**0.5 for _ in range(2)]  # gate, up
    lora_b = [torch.randn(slots_n, i, rank, generator=g) for _ in range(2)]
    ranks = [[8, 8], [4, 0], [0, 8]]
    slots = torch.tensor([0, 0, -1, 1, 1, 2, -1, 0, 2, 2, -1])
    stack = LoRAStack.from_lists(lora_a, lora_b, [0, i], ranks)
    delta = lora_add_cpu(x, torch.zeros(m, 2 * i), slots, stack)  # [M, 2I]
    packed = pack_linear_weight(w)
    got = cpu_linear_silu_mul(x, packed, b, i, delta)
    gate_up = x @ w.T + b  # [M, 2I]
    add_lora_grouped(x, gate_up, lora_a, lora_b, [0, i], ranks, token_groups(slots))
    torch.testing.assert_close(got, F.silu(gate_up[:, :i]) * gate_up[:, i:], rtol=1e-5, atol=1e-5)
    base = slots < 0
    assert torch.equal(got[base], cpu_linear_silu_mul(x, packed, b, i)[base])
