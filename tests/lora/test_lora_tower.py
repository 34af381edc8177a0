"""Tower LoRA: adapters that also target the vision tower's and the projector's linears (LLaVA: CLIP tower +
linear_1 / linear_2 projector; Qwen2-VL: the ViT blocks + the merger MLP). Image prompts with such an adapter, the
same image without it and with a decoder-only adapter, in one `LLM.generate` batch, equal HF + PEFT merged greedy
token for token; the adapter's image embeddings are cached apart from the base's (their mm_hash carries the
adapter)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tests.lora.lora_helpers import hf_vlm_greedy
from tests.multimodal.mm_media import rand_image
from vlserve import LLM, SamplingParams
from vlserve.lora import LoRARequest

MAX_NEW = 6
LM = r"language_model.*\.(q_proj|v_proj|o_proj|up_proj|down_proj)"
TOWER_TARGETS = {
    "llava": rf".*({LM}|vision_tower.*\.(q_proj|k_proj|v_proj|out_proj|fc1|fc2)|multi_modal_projector\.linear_[12])",
    "qwen2_vl": rf".*({LM}|visual\.blocks\.\d+\.(attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)|visual\.merger\.mlp\.[02])",
}
LM_ONLY = rf".*{LM}"
CONV = {"llava": r".*vision_tower.*patch_embedding", "qwen2_vl": r".*visual\.patch_embed\.proj"}


def _build(family: str, root) -> str:
    if family == "llava":
        from vlserve.demo.llava_checkpoints import build_llava_checkpoint

        return build_llava_checkpoint(str(root / "model"), variant="llava", tower="clip", text_model="llama")
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    return build_qwen2_vl_checkpoint(str(root / "model"))


def _adapter(model_dir: str, out_dir: str, targets: str, seed: int) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False, lora_dropout=0.0)
    get_peft_model(base, cfg).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def tower_case(request, tmp_path_factory):
    """(model dir, tower adapter dir, decoder-only adapter dir) per family."""
    root = tmp_path_factory.mktemp(f"tower_lora_{request.param}")
    model_dir = _build(request.param, root)
    tower = _adapter(model_dir, str(root / "tower"), TOWER_TARGETS[request.param], seed=1)
    lm_only = _adapter(model_dir, str(root / "lm"), LM_ONLY, seed=2)
    return model_dir, tower, lm_only


def _prompt(model_dir: str) -> str:
    from vlserve.multimodal.processor import load_hf_processor

    user = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    return load_hf_processor(model_dir).apply_chat_template(user, tokenize=False, add_generation_prompt=True)


def test_tower_adapter_matches_hf_peft_in_a_mixed_batch(tower_case):
    model_dir, tower_dir, lm_dir = tower_case
    text = _prompt(model_dir)
    images = [Image.fromarray(rand_image(56, 84, seed=0)), Image.fromarray(rand_image(70, 70, seed=1))]
    tower, lm = LoRARequest("tower", 1, tower_dir), LoRARequest("lm", 2, lm_dir)
    batch = [(images[0], tower), (images[0], None), (images[0], lm), (images[1], tower)]
    llm = LLM(
        model_dir, dtype="float32", device="cpu", num_kv_blocks=256, enable_lora=True, max_lora_rank=8, max_loras=2
    )
    outs = llm.generate(
        [{"prompt": text, "multi_modal_data": {"image": [img]}} for img, _ in batch],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
        use_tqdm=False,
        lora_request=[r for _, r in batch],
    )
    dirs = {None: None, tower: tower_dir, lm: lm_dir}
    for (img, r), out in zip(batch, outs):
        prompt_ids, new = hf_vlm_greedy(model_dir, dirs[r], text, img, MAX_NEW)
        assert out.prompt_token_ids == prompt_ids
        assert list(out.outputs[0].token_ids) == new, r.lora_name if r else "base"
    llm.check_integrity()


def test_tower_adapter_changes_the_image_embeddings_and_keys_them_apart(tower_case):
    """The runner encodes the same image once per adapter with tower weights: the base's entry and the adapter's
    differ, and a decoder-only adapter shares the base's."""
    from vlserve.lora.peft_checkpoint import adapter_targets_encoder

    model_dir, tower_dir, lm_dir = tower_case
    assert adapter_targets_encoder(tower_dir) and not adapter_targets_encoder(lm_dir)
    llm = LLM(
        model_dir, dtype="float32", device="cpu", num_kv_blocks=256, enable_lora=True, max_lora_rank=8, max_loras=2
    )
    image = Image.fromarray(rand_image(56, 84, seed=3))
    prompts = [{"prompt": _prompt(model_dir), "multi_modal_data": {"image": [image]}}] * 3
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(
        prompts,
        params,
        use_tqdm=False,
        lora_request=[None, LoRARequest("lm", 2, lm_dir), LoRARequest("tower", 1, tower_dir)],
    )
    # the base's run (shared by the decoder-only adapter) + the tower adapter's own
    assert llm.get_metrics()["vlserve:encoder_runs_total"] == 2
    llm.check_integrity()


def test_tower_adapter_on_a_conv_is_refused(tower_case, tmp_path):
    """A target that is no linear of ours (the patch embedding's conv) is a ValueError naming it."""
    model_dir, _, _ = tower_case
    family = "qwen2_vl" if "qwen2_vl" in str(model_dir) else "llava"
    bad = _adapter(model_dir, str(tmp_path / "conv"), CONV[family], seed=3)
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="patch_embed"):
        llm.generate(
            {"prompt": "hi"}, SamplingParams(max_tokens=1), use_tqdm=False, lora_request=LoRARequest("conv", 3, bad)
        )


def test_tower_adapter_over_the_server_with_the_engine_in_its_own_process(tower_case):
    """`--lora-modules tower=...` with the engine in its own process (the API process keys the items by adapter):
    an image chat with the tower adapter and one with the base each equal HF (+ PEFT merged) greedy."""
    from tests.api.test_engine_process import start_proc_server
    from tests.support.hf_oracle import data_url
    from vlserve.config import EngineArgs
    from vlserve.multimodal.processor import load_hf_processor

    model_dir, tower_dir, _ = tower_case
    image = Image.fromarray(rand_image(56, 84, seed=5))
    tokenizer = load_hf_processor(model_dir).tokenizer
    served = start_proc_server(
        EngineArgs(
            model=model_dir,
            served_model_name="base",
            dtype="float32",
            num_kv_blocks=128,
            enable_lora=True,
            max_lora_rank=8,
            lora_modules={"tower": tower_dir},
        )
    )
    try:
        for name, adapter in (("tower", tower_dir), ("base", None)):
            _, want = hf_vlm_greedy(model_dir, adapter, _prompt(model_dir), image, MAX_NEW)
            r = served.client.chat.completions.create(
                model=name,
                temperature=0,
                max_tokens=MAX_NEW,
                extra_body={"ignore_eos": True},
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": data_url(image)}},
                            {"type": "text", "text": "Describe it."},
                        ],
                    }
                ],
            )
            # a reply ending inside a UTF-8 sequence holds that partial character back
            want_text = tokenizer.decode(want, skip_special_tokens=True).rstrip("\ufffd")
            assert r.choices[0].message.content.rstrip("\ufffd") == want_text and want_text, name
    finally:
        served.close()
