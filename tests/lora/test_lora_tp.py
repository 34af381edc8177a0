"""LoRA under tensor parallel 2 (two gloo worker processes): A and B are sharded with their base layer (column-
parallel qkv / gate_up read their rank's rows of B, row-parallel o / down their rank's columns of A), KV heads split
(Qwen2, two KV heads) and replicated (Llama, one KV head). A batch mixing two adapters and the base equals HF +
PEFT merged greedy token for token, with prefill in chunks."""

from __future__ import annotations

import pytest
import torch

from tests.lora.lora_helpers import ALL, make_adapter
from tests.support.hf_generate import hf_greedy_continuations
from vlserve import LLM, SamplingParams
from vlserve.demo.checkpoints import build_text_checkpoint
from vlserve.lora import LoRARequest

pytestmark = pytest.mark.slow  # each TP engine starts two processes

MAX_NEW = 8
PROMPTS = [
    [5, 17, 42, 7, 99, 3, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    [64, 12, 8, 150, 33],
    [21, 77, 9, 4, 61, 88, 2],
    [13, 14, 15],
    [40, 41, 42, 43, 44, 45, 46, 47],
]


def _merged(model_dir: str, adapter_dir: str, out_dir) -> str:
    """HF + PEFT with the adapter merged into the weights, saved as a plain checkpoint."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().save_pretrained(str(out_dir))
    return str(out_dir)


@pytest.mark.parametrize("arch,kv_heads", [("qwen2", 2), ("llama", 1)], ids=["kv-split", "kv-replicated"])
def test_tp2_mixed_adapters_equal_hf_peft(arch, kv_heads, tmp_path):
    model_dir = build_text_checkpoint(str(tmp_path / "model"), arch=arch, num_heads=4, num_kv_heads=kv_heads)
    a1 = make_adapter(model_dir, tmp_path / "a1", ALL, r=4, alpha=8, seed=1)[0]
    a2 = make_adapter(
        model_dir, tmp_path / "a2", ["q_proj", "k_proj", "v_proj", "o_proj"], r=8, alpha=16, seed=2, use_rslora=True
    )[0]
    loras = [None, LoRARequest("a1", 1, a1), LoRARequest("a2", 2, a2), LoRARequest("a1", 1, a1), None]
    want = {
        None: hf_greedy_continuations(model_dir, PROMPTS, MAX_NEW),
        "a1": hf_greedy_continuations(_merged(model_dir, a1, tmp_path / "m1"), PROMPTS, MAX_NEW),
        "a2": hf_greedy_continuations(_merged(model_dir, a2, tmp_path / "m2"), PROMPTS, MAX_NEW),
    }
    llm = LLM(
        model_dir,
        dtype="float32",
        num_kv_blocks=128,
        max_num_batched_tokens=16,
        tensor_parallel_size=2,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
            use_tqdm=False,
            lora_request=loras,
        )
        for i, (out, lora) in enumerate(zip(outs, loras)):
            name = lora.lora_name if lora else None
            assert list(out.outputs[0].token_ids) == want[name][i], (i, name)
        assert want["a1"] != want[None] and want["a2"] != want[None]  # the adapters change the output
        llm.check_integrity()
    finally:
        llm.shutdown()
