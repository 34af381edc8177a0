"""Mistral 3 (Pixtral tower, patch-merging projector, Mistral decoder): the tower + projector against HF's modules,
placeholder runs ([IMG] per column, [IMG_BREAK] per row, [IMG_END] last) against HF's PixtralProcessor, greedy
parity with HF generate through LLM.generate / LLM.chat / the server for text, one image and two images of different
sizes; chunked prefill through image runs with forced preemption, prefix caching with the encoder cache, and tensor
parallel 2."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tests.multimodal.mm_media import rand_image
from tests.multimodal.mm_server import assert_server_image_parity
from tests.support.hf_oracle import HFImageTextOracle, data_url
from vlserve import LLM, SamplingParams

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

MAX_NEW = 8
# (height, width): wide, tall, square at the longest edge, small, a strip, one past the edge
SIZES = [(40, 70), (90, 30), (96, 96), (20, 24), (12, 200), (97, 50)]


def _img(size, seed: int) -> Image.Image:
    return Image.fromarray(rand_image(*size, seed=seed))


def _greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory):
    from tests.support.mistral3_checkpoints import build_mistral3_checkpoint

    return build_mistral3_checkpoint(str(tmp_path_factory.mktemp("mistral3")))


class Mistral3Oracle(HFImageTextOracle):
    """The checkpoint's AutoProcessor + AutoModelForImageTextToText greedy generate (float32)."""

    def __init__(self, model_dir: str):
        super().__init__(model_dir, MAX_NEW)


@pytest.fixture(scope="module")
def oracle(m3_dir):
    return Mistral3Oracle(m3_dir)


def _cases(oracle):
    img_a, img_b = _img(SIZES[0], seed=1), _img(SIZES[0], seed=2)
    return [
        ("one image", oracle.text(1, "What is this?"), [img_a]),
        ("other image", oracle.text(1, "What is this?"), [img_b]),
        ("two sizes", oracle.text(2, "Compare them."), [_img(SIZES[1], seed=3), img_a]),
        ("text only", oracle.text(0, "Hello there"), []),
    ]


@pytest.fixture(scope="module")
def expected(oracle):
    return [oracle.run(text, imgs) for _, text, imgs in _cases(oracle)]


def _run(llm, cases, sp=None):
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs}} for _, text, imgs in cases]
    return llm.generate(prompts, sp or _greedy(), use_tqdm=False)


def _as_image_tokens(ids: list[int], tok) -> list[int]:
    """`ids` with [IMG_BREAK] / [IMG_END] written as [IMG] (the engine's prompt ids may hold either: the runner
    writes each image's whole run of embeddings, break / end rows included)."""
    img, brk, end = tok.convert_tokens_to_ids(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    return [img if t in (brk, end) else t for t in ids]


def _image_features(out):
    """get_image_features' per-image features: 5.x returns an output object (`.pooler_output`), 4.57 a plain
    tuple of tensors."""
    return out.pooler_output if hasattr(out, "pooler_output") else out


def test_tower_and_projector_match_hf(oracle):
    from vlserve.models.mistral3 import Mistral3ForConditionalGeneration
    from vlserve.multimodal.mistral3_items import patch_rows

    hf = oracle.model
    ours = Mistral3ForConditionalGeneration(hf.config)
    ours.vision_tower.load_state_dict(hf.model.vision_tower.state_dict(), strict=True)  # same names and shapes
    ours.multi_modal_projector.load_state_dict(hf.model.multi_modal_projector.state_dict(), strict=True)
    ours.to(oracle.device)
    imgs = [_img(s, seed=i) for i, s in enumerate(SIZES[:4])]
    inputs = oracle.processor.image_processor(images=imgs, return_tensors="pt", patch_size=32)  # padded batch
    sizes = inputs["image_sizes"]
    with torch.no_grad():
        want = torch.cat(
            _image_features(
                hf.model.get_image_features(
                    pixel_values=inputs["pixel_values"].to(oracle.device), image_sizes=sizes.to(oracle.device)
                )
            )
        )
        rows = torch.cat([patch_rows(px[:, :h, :w], 16) for px, (h, w) in zip(inputs["pixel_values"], sizes.tolist())])
        got = ours.image_features(rows, ours.patch_grids(sizes))  # [sum of tokens, H]
    assert got.shape == want.shape and len({tuple(s) for s in sizes.tolist()}) == 4
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_placeholder_ids_match_hf_processor(m3_dir):
    """Our run spelling equals HF's expansion exactly for many sizes; the engine's prompt has runs of the same
    length at the same place; max_image_embeds bounds them all."""
    from vlserve.multimodal.processor import MultiModalProcessor

    proc = MultiModalProcessor.from_pretrained(m3_dir)
    hf = proc.hf_processor
    family = proc.family
    prompt = "[INST][IMG]x[/INST]"
    counts = []
    for i, size in enumerate(SIZES + [(1, 1), (33, 33), (64, 96), (300, 301), (50, 500)]):
        img = _img(size, seed=i)
        ids, feats = proc.process(hf.tokenizer(prompt)["input_ids"], [img])
        want = hf(text=[prompt], images=[img], return_tensors="pt")["input_ids"][0].tolist()
        feat = feats[0]
        run = ids[: feat.offset] + family.placeholder_ids(feat.data) + ids[feat.offset + feat.length :]
        assert run == want, size
        assert _as_image_tokens(ids, hf.tokenizer) == _as_image_tokens(want, hf.tokenizer), size
        counts.append(feat.length)
    assert max(counts) <= proc.max_image_embeds()
    assert len(set(counts)) > 4  # the count follows size and aspect ratio


def test_generate_and_chat_parity_with_hf(m3_dir, oracle, expected):
    llm = LLM(m3_dir, dtype="float32", num_kv_blocks=256)
    cases = _cases(oracle)
    tok = oracle.processor.tokenizer
    for (name, *_), out, (hf_prompt, hf_new) in zip(cases, _run(llm, cases), expected):
        assert _as_image_tokens(out.prompt_token_ids, tok) == _as_image_tokens(hf_prompt, tok), name
        assert list(out.outputs[0].token_ids) == hf_new, name
    assert expected[0][1] != expected[1][1], "different images must give different outputs"
    url = data_url(cases[0][2][0])
    chat = llm.chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
        _greedy(),
        use_tqdm=False,
    )
    assert list(chat[0].outputs[0].token_ids) == expected[0][1]
    llm.check_integrity()


def test_chunked_prefill_8_with_forced_preemption(m3_dir, oracle, expected):
    # 8-token steps split every image's run; 4 blocks x 16 slots cannot hold the batch at once
    llm = LLM(
        m3_dir, dtype="float32", num_kv_blocks=4, block_size=16, max_num_batched_tokens=8, enable_prefix_caching=False
    )
    assert [list(o.outputs[0].token_ids) for o in _run(llm, _cases(oracle))] == [e[1] for e in expected]
    assert llm.get_metrics()["vlserve:num_preemptions_total"] > 0
    llm.check_integrity()


def test_prefix_caching_and_encoder_cache(m3_dir, oracle, expected):
    llm = LLM(m3_dir, dtype="float32", num_kv_blocks=128, block_size=16)
    cases = _cases(oracle)[:2]
    first = [list(o.outputs[0].token_ids) for o in _run(llm, cases)]
    again = [list(o.outputs[0].token_ids) for o in _run(llm, cases)]  # same prompts: prefix hits, no encoding
    assert first == again == [e[1] for e in expected[:2]]
    m = llm.get_metrics()
    assert m["vlserve:prefix_cache_hits_total"] > 0
    assert m["vlserve:encoder_runs_total"] == 2
    img = _img((60, 90), seed=11)
    outs = llm.generate([f"Question {i}?" for i in range(6)], _greedy(3), images=[[img]] * 6, use_tqdm=False)
    assert len(outs) == 6 and llm.get_metrics()["vlserve:encoder_runs_total"] == 3  # the same image: once
    llm.check_integrity()


def test_server_image_url_parity_with_hf(m3_dir, oracle, expected):
    _, text, imgs = _cases(oracle)[0]
    assert_server_image_parity(
        m3_dir,
        imgs[0],
        expected[0][1],
        oracle.processor.tokenizer,
        oracle.inputs(text, imgs)["input_ids"].shape[1],
        MAX_NEW,
        "tiny-mistral3",
    )


def test_module_layout_checkpoint_loads_the_same(m3_dir, tmp_path):
    """The in-memory module layout (`model.vision_tower.*`, `model.multi_modal_projector.*`,
    `model.language_model.*`, `lm_head.weight`) loads to the same tensors as the saved one."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from vlserve.models.loader import load_model

    cfg = AutoConfig.from_pretrained(m3_dir)
    ref = load_model(m3_dir, cfg, "float32", "cpu").state_dict()
    renames = (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    )
    out = {}
    for name, t in load_file(os.path.join(m3_dir, "model.safetensors")).items():
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        out[name] = t
    dst = str(tmp_path / "module_layout")
    shutil.copytree(m3_dir, dst)
    save_file(out, os.path.join(dst, "model.safetensors"))
    got = load_model(dst, cfg, "float32", "cpu").state_dict()
    assert list(got) == list(ref)
    for name, t in ref.items():
        assert torch.equal(t, got[name]), name


@pytest.mark.slow
def test_tensor_parallel_2_matches_hf(m3_dir, oracle, expected):
    llm = LLM(m3_dir, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=8, tensor_parallel_size=2)
    try:
        assert [list(o.outputs[0].token_ids) for o in _run(llm, _cases(oracle))] == [e[1] for e in expected]
        llm.check_integrity()
    finally:
        llm.shutdown()
