"""LoRA on a multimodal base: a tiny LLaVA (CLIP tower, llama LM) with a PEFT adapter on its language model's
projections (a regex target, so the tower's q/k/v/out projections stay untouched); image prompts through `LLM` with
the adapter and without, in one batch, equal HF + PEFT merged (`merge_and_unload`) greedy, EOS ignored."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tests.lora.lora_helpers import hf_vlm_greedy
from tests.multimodal.mm_media import rand_image
from vlserve import LLM, SamplingParams
from vlserve.lora import LoRARequest

MAX_NEW = 8
LM_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """(checkpoint dir, adapter dir) for a tiny LLaVA-1.5 and a random adapter on its language model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from vlserve.demo.llava_checkpoints import build_llava_checkpoint

    root = tmp_path_factory.mktemp("lora_llava")
    model_dir = build_llava_checkpoint(str(root / "llava"), variant="llava", tower="clip", text_model="llama")
    torch.manual_seed(4)
    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=LM_TARGETS, init_lora_weights=False, lora_dropout=0.0)
    get_peft_model(base, cfg).save_pretrained(str(root / "adapter"))
    return model_dir, str(root / "adapter")


def test_image_prompts_with_an_adapter_match_hf_peft(llava):
    from vlserve.multimodal.processor import load_hf_processor

    model_dir, adapter_dir = llava
    text = load_hf_processor(model_dir).apply_chat_template(
        _user("What is this?"), tokenize=False, add_generation_prompt=True
    )
    images = [Image.fromarray(rand_image(40, 60, seed=0)), Image.fromarray(rand_image(50, 50, seed=1))]
    lora = LoRARequest("lm", 1, adapter_dir)
    batch = [(images[0], lora), (images[0], None), (images[1], lora)]
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=256, enable_lora=True, max_lora_rank=8)
    outs = llm.generate(
        [{"prompt": text, "multi_modal_data": {"image": [img]}} for img, _ in batch],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
        use_tqdm=False,
        lora_request=[r for _, r in batch],
    )
    for (img, r), out in zip(batch, outs):
        prompt_ids, new = hf_vlm_greedy(model_dir, adapter_dir if r else None, text, img, MAX_NEW)
        assert out.prompt_token_ids == prompt_ids
        assert list(out.outputs[0].token_ids) == new, "adapter" if r else "base"
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids  # the adapter changes the output
    llm.check_integrity()
