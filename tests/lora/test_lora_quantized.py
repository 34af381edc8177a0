"""LoRA over quantized bases (weight-only compressed-tensors W4A16, GPTQ 4-bit, AWQ): the adapter's delta is added
to the quantized layer's output, so a batch mixing the adapter and the base equals transformers on the dequantized
float weights with the PEFT adapter merged, greedy, token for token."""

from __future__ import annotations

import pytest
import torch

from tests.lora.lora_helpers import ALL, make_adapter
from tests.support.hf_generate import hf_greedy_continuations
from tests.support.quant_checkpoints import quantize_checkpoint
from vlserve import LLM, SamplingParams
from vlserve.demo.checkpoints import build_text_checkpoint
from vlserve.lora import LoRARequest

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 600, 2, 8, 31], [40, 41, 42, 43]]
MAX_NEW = 8


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_qbase")
    model_dir = build_text_checkpoint(
        str(root / "base"),
        arch="qwen2",
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        tie_word_embeddings=False,
    )
    return model_dir, make_adapter(model_dir, root / "adapter", ALL, r=8, alpha=16, seed=3)[0]


@pytest.mark.parametrize("scheme", ["ct-w4a16", "gptq-4", "awq"])
def test_adapter_on_a_quantized_base_matches_hf_on_dequantized_weights(base, scheme, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir, adapter_dir = base
    qdir = quantize_checkpoint(model_dir, str(tmp_path / "q"), scheme, dequantized_dst=str(tmp_path / "f"))
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "f"), dtype=torch.float32), adapter_dir
    ).merge_and_unload()
    merged.save_pretrained(str(tmp_path / "m"))
    want_base = hf_greedy_continuations(str(tmp_path / "f"), PROMPTS, MAX_NEW)
    want_lora = hf_greedy_continuations(str(tmp_path / "m"), PROMPTS, MAX_NEW)
    assert want_lora != want_base  # the adapter changes the output
    llm = LLM(qdir, dtype="float32", device="cpu", num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("a", 1, adapter_dir)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS * 2],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
        use_tqdm=False,
        lora_request=[lora] * len(PROMPTS) + [None] * len(PROMPTS),
    )
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == want_lora + want_base
    llm.check_integrity()
