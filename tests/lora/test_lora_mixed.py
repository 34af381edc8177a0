"""A mixed step: three adapters and base rows in one forward equal each sequence run alone; base rows are
bit-identical to the same step without LoRA; the grouped path equals the per-token (bgmv) reference."""

from __future__ import annotations

import pytest
import torch

from tests.lora.lora_helpers import ALL, make_adapter, our_model
from tests.support.paged_runner import PagedRunner
from vlserve.kernels.lora_ref import add_lora_grouped, bgmv_expand_slice, bgmv_shrink, token_groups
from vlserve.kernels.packed_linear import pack_linears_for_cpu
from vlserve.lora import LoRAModelManager, LoRARequest, lora_step

PROMPTS = {
    "b0": [5, 17, 42, 7, 99, 3],
    "s1": [64, 12, 8, 150, 33],
    "s2": [21, 77, 9, 4, 61, 88, 2],
    "s3": [13, 14, 15],
    "b4": [40, 41, 42, 43],
}


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """Three adapters over the llama checkpoint: all projections r=4; attention only r=8; MLP only r=2 rslora."""
    model_dir, _ = checkpoint("llama")
    d = tmp_path_factory.mktemp("adapters")
    specs = [
        (ALL, 4, 8, {}),
        (["q_proj", "k_proj", "v_proj", "o_proj"], 8, 16, {}),
        (["gate_proj", "up_proj", "down_proj"], 2, 4, {"use_rslora": True}),
    ]
    return {
        f"s{i + 1}": LoRARequest(f"a{i + 1}", i + 1, make_adapter(model_dir, d / f"a{i}", t, r, a, seed=i, **kw)[0])
        for i, (t, r, a, kw) in enumerate(specs)
    }


def _run(model, cfg, manager, seqs, adapters, decode_steps=2):
    """Prefill `seqs` in one step, then greedy decode steps (all in one batch); {sid: [logits per step]}."""
    runner = PagedRunner(model, cfg, block_size=4, lora_manager=manager)
    out = runner.step([(s, PROMPTS[s]) for s in seqs], adapters=adapters)
    logs = {s: [out[s]] for s in seqs}
    for _ in range(decode_steps):
        out = runner.step([(s, [int(logs[s][-1][-1].argmax())]) for s in seqs], adapters=adapters)
        for s in seqs:
            logs[s].append(out[s])
    return logs


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_mixed_batch_equals_alone(packed, checkpoint, adapters):
    model_dir, cfg = checkpoint("llama")
    model = our_model(model_dir, cfg)
    if packed:
        pack_linears_for_cpu(model)
    manager = LoRAModelManager(model, max_loras=3, max_lora_rank=8)
    seqs = list(PROMPTS)
    mixed = _run(model, cfg, manager, seqs, adapters)
    no_lora = _run(model, cfg, None, seqs, {})
    for sid in seqs:
        alone = _run(model, cfg, manager, [sid], adapters)[sid]
        for got, want in zip(mixed[sid], alone):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if sid.startswith("b"):  # base rows: bit for bit what the step gives without LoRA
            assert all(torch.equal(a, b) for a, b in zip(mixed[sid], no_lora[sid]))
        else:
            assert (mixed[sid][0] - no_lora[sid][0]).abs().max() > 0.05


def test_per_token_slots_interleaved(checkpoint, adapters):
    """Non-contiguous groups (index path): slots given per token, interleaved over one prefill."""
    model_dir, cfg = checkpoint("llama")
    model = our_model(model_dir, cfg)
    manager = LoRAModelManager(model, max_loras=3, max_lora_rank=8)
    reqs = list(adapters.values())
    for req in reqs:
        manager.add_adapter(req)
    ids = [5, 17, 42, 7, 99, 3, 64, 12, 8]
    per_token = [None, 1, 2, 1, None, 3, 3, 2, None]
    with torch.inference_mode():  # as the runner calls it: slots written inside inference mode
        slots = manager.prepare_step(per_token)
    lin = model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(len(ids), lin.in_features)
    with torch.no_grad():
        with lora_step(slots):
            got = lin(x)
        base = lin(x)
        want = base.clone()
        for a, b, off in zip(lin.lora_a, lin.lora_b, lin.lora_offsets):
            bgmv_expand_slice(bgmv_shrink(x, a, slots), b, slots, want, off)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[slots < 0], base[slots < 0])
    assert any(not isinstance(rows, slice) for _, rows in token_groups(slots))


def test_grouped_matches_bgmv_reference():
    gen = torch.Generator().manual_seed(0)
    L, R, I, outs = 4, 8, 16, [12, 6, 6]
    a = [torch.randn(L, R, I, generator=gen) for _ in outs]
    b = [torch.randn(L, o, R, generator=gen) for o in outs]
    ranks = [[8, 8, 8], [3, 0, 5], [0, 0, 0], [8, 2, 1]]
    for s in range(L):  # zero padding past each rank, as the layers keep it
        for i, r in enumerate(ranks[s]):
            a[i][s, r:] = 0
            b[i][s, :, r:] = 0
    slots = torch.tensor([3, -1, 0, 0, 1, 3, -1, 1, 2, 0])
    x = torch.randn(len(slots), I, generator=gen)
    out = torch.randn(len(slots), sum(outs), generator=gen)
    want = out.clone()
    offsets = [0, 12, 18]
    for ai, bi, off in zip(a, b, offsets):
        bgmv_expand_slice(bgmv_shrink(x, ai, slots), bi, slots, want, off)
    got = out.clone()
    add_lora_grouped(x, got, a, b, offsets, ranks, token_groups(slots))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[slots < 0], out[slots < 0])
