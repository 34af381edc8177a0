"""Helpers for the LoRA tests: random PEFT adapters over tiny checkpoints, the HF reference and our model."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from vlserve.models import load_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_model(model_dir: str):
    """The HF reference (float32, eager attention, eval)."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def make_adapter(model_dir: str, out_dir: str, targets=ALL, r: int = 4, alpha: float = 8, seed: int = 0, **kw):
    """Save a random PEFT adapter (B not zero: init_lora_weights=False) over `model_dir` to `out_dir`; returns
    `(out_dir, the PeftModel)` (the reference forward)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, lora_dropout=0.0, **kw)
    peft_model = get_peft_model(hf_model(model_dir), cfg).eval()
    peft_model.save_pretrained(out_dir)
    return str(out_dir), peft_model


def our_model(model_dir: str, hf_config):
    """Our float32 CPU model of the checkpoint."""
    return load_model(model_dir, hf_config, torch.float32, "cpu")


def hf_vlm_greedy(model_dir: str, adapter_dir: str | None, text: str, image, max_new: int):
    """HF (+ PEFT merged when `adapter_dir`) greedy on one image prompt, EOS ignored -> (prompt ids, new ids)."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from tests.support.hf_generate import hf_greedy_ignoring_eos
    from vlserve.multimodal.processor import load_hf_processor

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()
    inputs = load_hf_processor(model_dir)(text=[text], images=[image], return_tensors="pt")
    out = hf_greedy_ignoring_eos(model, inputs, max_new)
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist()
