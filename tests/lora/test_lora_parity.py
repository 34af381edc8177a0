"""Our decoder through LoRAModelManager with one adapter vs HF + PEFT (`PeftModel` forward), float32: prefill and
decode steps over the paged cache, every projection targeted or a subset, llama / qwen2 / qwen3, packed or not."""

from __future__ import annotations

import pytest
import torch

from tests.lora.lora_helpers import ALL, make_adapter, our_model
from tests.support.paged_runner import PagedRunner
from vlserve.kernels.packed_linear import pack_linears_for_cpu
from vlserve.lora import LoRAModelManager, LoRARequest

ATOL = RTOL = 1e-4
PROMPT = [5, 17, 42, 7, 99, 3, 64, 12, 8, 150, 33, 21, 77]

CASES = [
    ("llama", ALL, False),
    ("llama", ["q_proj", "v_proj", "down_proj"], True),
    ("qwen2", ALL, True),
    ("qwen2", ["k_proj", "o_proj", "gate_proj"], False),
    ("qwen3", ["q_proj", "up_proj", "down_proj"], True),
]


@pytest.mark.parametrize(
    "arch,targets,packed", CASES, ids=[f"{a}-{len(t)}-{'packed' if p else 'plain'}" for a, t, p in CASES]
)
def test_one_adapter_matches_peft(arch, targets, packed, checkpoint, tmp_path):
    model_dir, cfg = checkpoint(arch)
    adapter_dir, ref = make_adapter(model_dir, tmp_path / "a", targets, r=8, alpha=16, seed=1)
    ours = our_model(model_dir, cfg)
    if packed:
        pack_linears_for_cpu(ours)
    manager = LoRAModelManager(ours, max_loras=2, max_lora_rank=16)
    req = LoRARequest("a", 1, adapter_dir)
    runner = PagedRunner(ours, cfg, block_size=4, lora_manager=manager)
    base_runner = PagedRunner(ours, cfg, block_size=4)

    out = runner.step([("x", PROMPT)], adapters={"x": req})["x"]
    base = base_runner.step([("x", PROMPT)])["x"]
    with torch.no_grad():
        r = ref(torch.tensor([PROMPT]), use_cache=True)
    assert (r.logits[0] - base).abs().max() > 0.05  # the adapter really changes the logits
    torch.testing.assert_close(out, r.logits[0], atol=ATOL, rtol=RTOL)
    past, tok = r.past_key_values, int(r.logits[0, -1].argmax())
    for _ in range(3):
        out = runner.step([("x", [tok])], adapters={"x": 1})["x"]
        with torch.no_grad():
            r = ref(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        torch.testing.assert_close(out, r.logits[0], atol=ATOL, rtol=RTOL)
        past, tok = r.past_key_values, int(r.logits[0, -1].argmax())
