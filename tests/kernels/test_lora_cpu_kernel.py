"""The fused C++ LoRA kernel (`kernels.lora_cpu`) against the torch twin (`kernels.lora_ref.add_lora_grouped`) and the
per-token reference (`bgmv_shrink` / `bgmv_expand_slice`): mixed slots with -1 and non-contiguous runs, ranks that
differ per slot and slice (0 included), qkv-like slices at offsets, float32 and bf16, 1 and 2 threads; rows of no
adapter bit-identical; the stack's views and the fallbacks."""

from __future__ import annotations

import pytest
import torch

from vlserve.kernels import lora_cpu
from vlserve.kernels.lora_cpu import (
    LoRAStack,
    lora_add,
    lora_add_cpu,
    lora_add_cpu_lists,
    lora_add_ref,
    lora_cpu_kernel,
    lora_cpu_supported,
)
from vlserve.kernels.lora_ref import add_lora_grouped, bgmv_expand_slice, bgmv_shrink, token_groups

pytestmark = pytest.mark.skipif(lora_cpu_kernel() is None, reason="no C++ toolchain for the LoRA kernel here")

L, R = 5, 16
SIZES = [96, 40, 40]  # q, k, v widths (k/v not multiples of 8: ragged column tails)
OFFSETS = [0, 96, 136]
RANKS = [[16, 8, 0], [4, 4, 4], [0, 0, 0], [16, 16, 16], [1, 0, 7]]  # slot 2: no weights at all


def _weights(dtype, in_features=200, sizes=SIZES, ranks=RANKS, seed=0):
    """Per-slice A [L, R, I] / B [L, O_s, R] with padding past each slot's rank zeroed, as set_lora leaves them."""
    g = torch.Generator().manual_seed(seed)
    lora_a = [torch.randn(L, R, in_features, generator=g) / in_features**0.5 for _ in sizes]
    lora_b = [torch.randn(L, n, R, generator=g) / R**0.5 for n in sizes]
    for q in range(len(sizes)):
        for slot in range(L):
            lora_a[q][slot, ranks[slot][q] :] = 0
            lora_b[q][slot, :, ranks[slot][q] :] = 0
    return [a.to(dtype) for a in lora_a], [b.to(dtype) for b in lora_b]


def _slots(T, seed=1):
    """Slots in runs (as requests' tokens are) with -1 rows and a slot that comes back later (non-contiguous)."""
    g = torch.Generator().manual_seed(seed)
    if T == 1:
        return torch.tensor([3])
    slots = torch.randint(-1, L, (T,), generator=g)
    slots[: T // 3] = 1
    slots[T // 3 : T // 2] = -1
    slots[-1] = 1  # slot 1 again, after others
    return slots


def _bgmv_reference(x, out, slots, lora_a, lora_b):
    """The per-token reference in float64 (ranks enter through the zeroed padding)."""
    ref = out.double().clone()
    for a, b, off in zip(lora_a, lora_b, OFFSETS):
        y = bgmv_shrink(x.double(), a.double(), slots)  # [T, R]
        bgmv_expand_slice(y, b.double(), slots, ref, off)
    return ref


@pytest.mark.parametrize("T", [1, 7, 300])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_references(T, threads, dtype):
    lora_a, lora_b = _weights(dtype)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, 200, generator=g).to(dtype)
    out = torch.randn(T, sum(SIZES), generator=g).to(dtype)
    slots = _slots(T)
    got = lora_add_cpu_lists(x, out.clone(), slots, lora_a, lora_b, OFFSETS, RANKS, threads=threads)
    base = slots < 0
    assert torch.equal(got[base], out[base])  # rows of no adapter: untouched, bit for bit
    twin = out.clone()
    add_lora_grouped(x, twin, lora_a, lora_b, OFFSETS, RANKS, token_groups(slots))
    exact = _bgmv_reference(x, out, slots, lora_a, lora_b)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, twin, rtol=1e-5, atol=1e-5)
    else:  # one bf16 rounding of a float32 sum (the twin rounds y and the delta too)
        torch.testing.assert_close(got.double(), exact, rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(got.float(), twin.float(), rtol=3.2e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_do_not_change_the_result(dtype):
    """The work units do not depend on the thread count: 1 and 2 threads agree bit for bit."""
    lora_a, lora_b = _weights(dtype, in_features=1024, sizes=[1024, 264, 264])
    stack = LoRAStack.from_lists(lora_a, lora_b, [0, 1024, 1288], RANKS)
    x = torch.randn(300, 1024).to(dtype)
    out = torch.randn(300, 1552).to(dtype)
    slots = _slots(300)
    one = lora_add_cpu(x, out.clone(), slots, stack, threads=1)
    two = lora_add_cpu(x, out.clone(), slots, stack, threads=2)
    assert torch.equal(one, two)


def test_strided_rows_and_a_float32_delta_buffer():
    """x and out as column slices of wider tensors (rows strided); bf16 x into a float32 delta buffer."""
    lora_a, lora_b = _weights(torch.bfloat16)
    stack = LoRAStack.from_lists(lora_a, lora_b, OFFSETS, RANKS)
    slots = _slots(7)
    wide = torch.randn(7, 260).to(torch.bfloat16)
    x = wide[:, 30:230]  # [7, 200], rows 260 apart
    delta = torch.zeros(7, 200)[:, : sum(SIZES)]
    lora_add_cpu(x, delta, slots, stack)
    exact = _bgmv_reference(x, torch.zeros(7, sum(SIZES)), slots, lora_a, lora_b)
    torch.testing.assert_close(delta.double(), exact, rtol=1e-5, atol=1e-5)
    assert not delta[slots < 0].any()


def test_slot_past_the_stack_and_empty_steps_are_skipped():
    lora_a, lora_b = _weights(torch.float32)
    stack = LoRAStack.from_lists(lora_a, lora_b, OFFSETS, RANKS)
    x, out = torch.randn(4, 200), torch.randn(4, sum(SIZES))
    got = lora_add_cpu(x, out.clone(), torch.tensor([-1, L, 2, 2 * L]), stack)  # 2: a slot with no weights
    assert torch.equal(got, out)
    assert lora_add_cpu(x[:0], out[:0], torch.tensor([], dtype=torch.int64), stack).shape == (0, sum(SIZES))


def test_stack_views_write_through_and_feed_the_twin():
    """`LoRAStack.zeros` + writes into its per-slice views (what set_lora would do) = `from_lists`; the twin over
    the views (`lora_add_ref`) agrees with the kernel."""
    lora_a, lora_b = _weights(torch.float32)
    stack = LoRAStack.zeros(L, R, 200, OFFSETS, SIZES, torch.float32)
    for view, a in zip(stack.lora_a_views(), lora_a):
        view.copy_(a)
    for view, b in zip(stack.lora_b_views(), lora_b):
        view.copy_(b)
    stack.ranks.copy_(torch.tensor(RANKS, dtype=torch.int32))
    ref = LoRAStack.from_lists(lora_a, lora_b, OFFSETS, RANKS)
    assert torch.equal(stack.a, ref.a) and torch.equal(stack.b, ref.b) and stack.rank_lists() == RANKS
    x, out, slots = torch.randn(7, 200), torch.randn(7, sum(SIZES)), _slots(7)
    torch.testing.assert_close(
        lora_add_cpu(x, out.clone(), slots, stack), lora_add_ref(x, out.clone(), slots, stack), rtol=1e-5, atol=1e-5
    )


def test_single_slice_layer_at_decode_shape():
    """o_proj / down_proj-like: one slice over the whole output, 32 rows, 4 slots of rank 8."""
    g = torch.Generator().manual_seed(3)
    lora_a = [torch.randn(4, 8, 512, generator=g) / 512**0.5]
    lora_b = [torch.randn(4, 512, 8, generator=g) / 8**0.5]
    ranks = [[8]] * 4
    x, out = torch.randn(32, 512, generator=g), torch.randn(32, 512, generator=g)
    slots = torch.arange(32) % 4
    got = lora_add_cpu_lists(x, out.clone(), slots, lora_a, lora_b, [0], ranks)
    twin = out.clone()
    add_lora_grouped(x, twin, lora_a, lora_b, [0], ranks, token_groups(slots))
    torch.testing.assert_close(got, twin, rtol=1e-5, atol=1e-5)


def test_switch_off_and_no_compiler_fall_back(monkeypatch):
    lora_a, lora_b = _weights(torch.float32)
    stack = LoRAStack.from_lists(lora_a, lora_b, OFFSETS, RANKS)
    x, out, slots = torch.randn(7, 200), torch.randn(7, sum(SIZES)), _slots(7)
    expected = lora_add_cpu(x, out.clone(), slots, stack)
    assert lora_cpu_supported(torch.float32) and lora_cpu_supported(torch.bfloat16)
    assert not lora_cpu_supported(torch.float16) and not lora_cpu_supported(torch.float32, "meta")
    monkeypatch.setenv("VLSERVE_CPU_LORA_KERNEL", "0")
    assert not lora_cpu_supported(torch.float32)
    monkeypatch.setattr(lora_cpu, "lora_add_cpu", None)  # the fallback must not reach it
    torch.testing.assert_close(lora_add(x, out.clone(), slots, stack), expected, rtol=1e-5, atol=1e-5)
    monkeypatch.delenv("VLSERVE_CPU_LORA_KERNEL")
    monkeypatch.setattr(lora_cpu, "lora_cpu_kernel", lambda: None)  # as where no compiler works
    assert not lora_cpu_supported(torch.float32)
    torch.testing.assert_close(lora_add(x, out.clone(), slots, stack), expected, rtol=1e-5, atol=1e-5)


def test_dtype_mismatch_is_refused():
    lora_a, lora_b = _weights(torch.float32)
    stack = LoRAStack.from_lists(lora_a, lora_b, OFFSETS, RANKS)
    with pytest.raises(ValueError):
        lora_add_cpu(torch.randn(2, 200).bfloat16(), torch.zeros(2, sum(SIZES)), torch.tensor([0, 1]), stack)
