"""LLaVA-1.5 (CLIP / SigLIP towers) and LLaVA-NeXT (anyres) end to end: placeholder counts against HF's processors,
greedy parity with HF generate through LLM.generate / LLM.chat, chunked prefill and preemption, the encoder cache,
prefix hits, n-gram and EAGLE spec decode, both checkpoint layouts."""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from tests.multimodal.mm_media import rand_image
from vlserve import LLM, SamplingParams

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

MAX_NEW = 8
# (height, width): plain, extreme wide / tall strips, square, tiny
SIZES = [(40, 60), (32, 400), (400, 32), (50, 50), (9, 13)]
KINDS = {  # name -> build_llava_checkpoint kwargs
    "llava_clip": dict(variant="llava", tower="clip", text_model="llama"),
    "llava_siglip": dict(variant="llava", tower="siglip", text_model="qwen2", vision_feature_layer=[-3, -1]),
    "next_clip": dict(variant="llava_next", tower="clip", text_model="llama"),
}


def _img(size, seed):
    return Image.fromarray(rand_image(*size, seed=seed))


def _greedy(n=MAX_NEW):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _user(n_images: int, text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="session")
def llava_ckpts(tmp_path_factory):
    from vlserve.demo.llava_checkpoints import build_llava_checkpoint

    root = tmp_path_factory.mktemp("llava")
    return {k: build_llava_checkpoint(str(root / k), **kw) for k, kw in KINDS.items()}


class HFOracle:
    """The checkpoint's AutoProcessor + AutoModelForImageTextToText greedy generate (float32, the LLM's device)."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForImageTextToText

        from vlserve.multimodal.processor import load_hf_processor

        # AutoProcessor with the image processor vlserve serves with (torchvision-backed; 4.57 would load the slow
        # one these checkpoints were saved with), so that the models are compared on the same pixels; fast vs slow
        # pixels are compared in test_fast_processors.py.
        self.processor = load_hf_processor(model_dir)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval().to(self.device)

    def chat_text(self, n_images: int, text: str) -> str:
        return self.processor.apply_chat_template(_user(n_images, text), tokenize=False, add_generation_prompt=True)

    def greedy(self, text: str, images) -> tuple[list[int], list[int]]:
        """(prompt ids after placeholder expansion, greedy new tokens)."""
        from tests.support.hf_generate import hf_greedy_ignoring_eos

        inputs = self.processor(text=[text], images=images or None, return_tensors="pt").to(self.device)
        out = hf_greedy_ignoring_eos(self.model, inputs, MAX_NEW)
        n = inputs["input_ids"].shape[1]
        return inputs["input_ids"][0].tolist(), out[0, n:].tolist()


@pytest.fixture(scope="module", params=list(KINDS))
def case(request, llava_ckpts):
    """(kind, checkpoint dir, HF oracle, the HF results of the standard prompts)."""
    path = llava_ckpts[request.param]
    hf = HFOracle(path)
    prompts = _standard_prompts(hf)
    expected = [hf.greedy(text, imgs) for text, imgs in prompts]
    return request.param, path, hf, prompts, expected


def _standard_prompts(hf: HFOracle) -> list[tuple[str, list]]:
    one = [(hf.chat_text(1, "What is this?"), [_img(s, seed=i)]) for i, s in enumerate(SIZES)]
    two = (hf.chat_text(2, "Compare them."), [_img(SIZES[1], seed=7), _img(SIZES[0], seed=8)])
    return one + [two, (hf.chat_text(0, "Hello there"), [])]


def _generate(llm, prompts):
    reqs = [{"prompt": text, "multi_modal_data": {"image": imgs}} for text, imgs in prompts]
    return llm.generate(reqs, _greedy(), use_tqdm=False)


def test_greedy_parity_with_hf(case):
    kind, path, hf, prompts, expected = case
    llm = LLM(path, dtype="float32", num_kv_blocks=256)
    outs = _generate(llm, prompts)
    for (_text, imgs), out, (hf_prompt, hf_new) in zip(prompts, outs, expected):
        assert out.prompt_token_ids == hf_prompt, f"{kind}: placeholder expansion differs ({len(imgs)} images)"
        assert list(out.outputs[0].token_ids) == hf_new, f"{kind}: {len(imgs)} images"
    # LLM.chat and LLM.generate(images=...) with a plain prompt (wrapped in the chat template) agree with HF too
    img = prompts[1][1]
    message = {
        "role": "user",
        "content": [{"type": "image_pil", "image_pil": img[0]}, {"type": "text", "text": "What is this?"}],
    }
    chat = llm.chat([message], _greedy(), use_tqdm=False)
    plain = llm.generate(["What is this?"], _greedy(), images=[img], use_tqdm=False)
    assert list(chat[0].outputs[0].token_ids) == expected[1][1]
    assert list(plain[0].outputs[0].token_ids) == expected[1][1]
    llm.check_integrity()


def test_chunked_prefill_and_preemption(case):
    kind, path, _, prompts, expected = case
    llm = LLM(path, dtype="float32", num_kv_blocks=14, block_size=16, max_num_batched_tokens=32)
    outs = _generate(llm, prompts)
    assert [list(o.outputs[0].token_ids) for o in outs] == [e[1] for e in expected]
    if kind.startswith("next"):  # its long prompts overflow 14 blocks together
        assert llm.get_metrics()["vlserve:num_preemptions_total"] > 0
    llm.check_integrity()


def test_placeholder_counts_match_hf_processor(llava_ckpts):
    """Our per-image counts equal the HF processor's expansion for many sizes; max_image_embeds bounds them all."""
    from vlserve.multimodal.processor import MultiModalProcessor

    sizes = SIZES + [(1, 1), (3, 50), (28, 28), (56, 29), (29, 56), (100, 7), (7, 100), (84, 28), (300, 301), (57, 113)]
    for kind in ("llava_clip", "next_clip"):
        proc = MultiModalProcessor.from_pretrained(llava_ckpts[kind])
        hf = proc.hf_processor
        counts = []
        for i, size in enumerate(sizes):
            ids, feats = proc.process(hf.tokenizer("<image>x")["input_ids"], [_img(size, seed=i)])
            # HF 4.57 cannot tell the channel axis of a 1- or 3-row image by itself: state it for HF's own call
            layout = {"input_data_format": "channels_last"} if size[0] in (1, 3) else {}
            image = np.array(_img(size, seed=i)) if layout else _img(size, seed=i)
            want = hf(text=["<image>x"], images=[image], return_tensors="pt", **layout)["input_ids"][0].tolist()
            assert ids == want, f"{kind} {size}"
            counts.append(feats[0].length)
        assert max(counts) <= proc.max_image_embeds()
        if kind == "next_clip":
            assert len(set(counts)) > 3  # the count follows size and aspect ratio


def test_one_image_eight_requests_one_encoder_run_and_prefix_hits(llava_ckpts):
    for kind in ("llava_siglip", "next_clip"):
        llm = LLM(llava_ckpts[kind], dtype="float32", num_kv_blocks=256)
        img = _img((60, 90), seed=3)
        llm.generate([f"Question {i}?" for i in range(8)], _greedy(2), images=[[img]] * 8, use_tqdm=False)
        m = llm.get_metrics()
        assert m["vlserve:encoder_runs_total"] == 1, kind
        assert m["vlserve:prefix_cache_hits_total"] > 0, kind
        llm.check_integrity()


def test_ngram_and_eagle_spec_decode_equal_plain(llava_ckpts, tmp_path):
    from vlserve.spec_decode.eagle_heads import build_eagle_checkpoint

    path = llava_ckpts["next_clip"]
    hf = HFOracle.__new__(HFOracle)
    from transformers import AutoProcessor

    hf.processor = AutoProcessor.from_pretrained(path)
    prompts = [
        (hf.chat_text(1, "Say the same words the same words the same"), [_img(s, seed=i)])
        for i, s in enumerate(SIZES[:3])
    ]
    kw = dict(dtype="float32", num_kv_blocks=256, max_num_batched_tokens=32)
    base = [list(o.outputs[0].token_ids) for o in _generate(LLM(path, **kw), prompts)]
    head = build_eagle_checkpoint(str(tmp_path / "head"), path, "eagle", "random")
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
        {"method": "eagle", "num_speculative_tokens": 2, "model": head},
    ):
        llm = LLM(path, speculative_config=spec, **kw)
        assert [list(o.outputs[0].token_ids) for o in _generate(llm, prompts)] == base, spec["method"]
        assert llm.get_metrics()["vlserve:spec_decode_num_drafts_total"] > 0
        llm.check_integrity()


def test_module_layout_checkpoint_loads_the_same(llava_ckpts, tmp_path):
    """The in-memory module layouts (`model.language_model.*`, `lm_head.weight`, and the tower as 4.57's
    `model.vision_tower.vision_model.*` or 5.x's `model.vision_tower.*`) load to the same tensors as the saved one."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from vlserve.models.loader import load_model

    src = llava_ckpts["next_clip"]
    cfg = AutoConfig.from_pretrained(src)
    ref = load_model(src, cfg, "float32", "cpu").state_dict()
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for tower_prefix in ("model.vision_tower.vision_model.", "model.vision_tower."):
        renames = (
            ("language_model.model.", "model.language_model."),
            ("language_model.lm_head.", "lm_head."),
            ("vision_tower.vision_model.", tower_prefix),
            ("vision_tower.", tower_prefix),
            ("multi_modal_projector.", "model.multi_modal_projector."),
            ("image_newline", "model.image_newline"),
        )
        out = {}
        for name, t in tensors.items():
            for old, new in renames:
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            out[name] = t
        assert not any(n.startswith(("language_model.", "vision_tower.")) for n in out)
        dst = str(tmp_path / tower_prefix.replace(".", "_"))
        shutil.copytree(src, dst)
        save_file(out, os.path.join(dst, "model.safetensors"))
        got = load_model(dst, cfg, "float32", "cpu").state_dict()
        assert list(got) == list(ref)
        for name, t in ref.items():
            assert torch.equal(t, got[name]), (tower_prefix, name)


def test_bad_inputs_raise_value_errors(llava_ckpts):
    from vlserve.encoders.clip_vision import feature_layer_indices
    from vlserve.models.llava import build_vision_tower

    llm = LLM(llava_ckpts["llava_clip"], dtype="float32", num_kv_blocks=64, limit_mm_per_prompt={"image": 1})
    img = _img((30, 30), seed=1)
    with pytest.raises(ValueError, match=r"2 image placeholder tokens \(<image>\) but 1 images"):
        llm.generate({"prompt": "<image><image> hi", "multi_modal_data": {"image": [img]}}, _greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        llm.generate("hi", _greedy(), images=[[img, img]], use_tqdm=False)
    with pytest.raises(ValueError, match="vision_feature_layer 3 is out of range"):
        feature_layer_indices([0, 3], depth=2)
    with pytest.raises(ValueError, match="LLaVA vision tower 'timm_wrapper' is not supported"):
        build_vision_tower(SimpleNamespace(model_type="timm_wrapper"))
