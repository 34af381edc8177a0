"""Gemma 3 vision-language model (SigLIP tower read after post_layernorm, avg-pool + RMSNorm + matmul projector,
Gemma 3 text decoder): prompt ids against HF's Gemma3Processor (one image, two images, pan-and-scan, text around the
runs tokenized anew), weight loading in both checkpoint layouts, tower + projector against HF's
`get_image_features`, logits over the paged cache with the bidirectional image mask, and greedy parity with HF
generate through LLM.generate / LLM.chat (float32)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from PIL import Image

from tests.multimodal.mm_media import rand_image
from tests.support.hf_oracle import HFImageTextOracle, data_url
from vlserve import LLM, SamplingParams

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

MAX_NEW = 8
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}  # crops for the small test images
# (height, width): wide, tall, square, small, very wide (4 crops with pan-and-scan), near square (no crops)
SIZES = [(40, 90), (100, 30), (48, 48), (12, 20), (20, 200), (50, 56)]


# checkpoint piece -> (our fused weight, its place in it)
PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _img(size, seed: int) -> Image.Image:
    return Image.fromarray(rand_image(*size, seed=seed))


def _greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def g3_dir(tmp_path_factory):
    from tests.support.gemma3_checkpoints import build_gemma3_vlm_checkpoint

    return build_gemma3_vlm_checkpoint(str(tmp_path_factory.mktemp("gemma3_vlm")))


class Gemma3Oracle(HFImageTextOracle):
    """HF greedy generate, keeping the processor's `token_type_ids`: HF's Gemma 3 builds its bidirectional image
    mask from them."""

    def inputs(self, text: str, images=None, videos=None, **kwargs):
        return self.processor(text=[text], images=images or None, return_tensors="pt", **kwargs).to(self.device)


@pytest.fixture(scope="module")
def oracle(g3_dir):
    return Gemma3Oracle(g3_dir, MAX_NEW)


def _cases(oracle):
    img_a, img_b = _img(SIZES[0], seed=1), _img(SIZES[0], seed=2)
    return [
        ("text only", oracle.text(0, "Hello there"), [], None),
        ("one image", oracle.text(1, "What is this?"), [img_a], None),
        ("other image", oracle.text(1, "What is this?"), [img_b], None),
        ("two images", oracle.text(2, "Compare them."), [_img(SIZES[1], seed=3), img_a], None),
        ("pan and scan", oracle.text(2, "Compare them."), [img_a, _img(SIZES[1], seed=3)], PAN_AND_SCAN),
    ]


@pytest.fixture(scope="module")
def expected(oracle):
    return [oracle.run(text, imgs, **(kw or {})) for _, text, imgs, kw in _cases(oracle)]


def _run(llm, cases, sp=None):
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": imgs} if imgs else {}, "mm_processor_kwargs": kw}
        for _, text, imgs, kw in cases
    ]
    return llm.generate(prompts, sp or _greedy(), use_tqdm=False)


def _image_features(out):
    """get_image_features' output: 5.x an output object (`.pooler_output`), 4.57 the tensor."""
    return out.pooler_output if hasattr(out, "pooler_output") else out


# ---- prompt ids ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [None, PAN_AND_SCAN], ids=["plain", "pan_and_scan"])
def test_prompt_ids_match_hf_processor(g3_dir, kwargs):
    """Expanded ids equal Gemma3Processor's exactly (one and two images, images next to each other, a system
    message before them); one feature per crop covering exactly a run of soft tokens."""
    from vlserve.multimodal.processor import MultiModalProcessor

    proc = MultiModalProcessor.from_pretrained(g3_dir)
    hf = proc.hf_processor
    soft = hf.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    boi = hf.tokenizer.convert_tokens_to_ids("<start_of_image>")
    assert proc.image_token_id == boi and proc.max_image_embeds() == 16
    prompts = [
        (
            hf.apply_chat_template(
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi?"}]}],
                tokenize=False,
                add_generation_prompt=True,
            ),
            1,
        ),
        (
            hf.apply_chat_template(
                [
                    {"role": "system", "content": "Be brief."},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "One"},
                            {"type": "image"},
                            {"type": "text", "text": "two"},
                            {"type": "image"},
                        ],
                    },
                ],
                tokenize=False,
                add_generation_prompt=True,
            ),
            2,
        ),
        ("<bos>a<start_of_image><start_of_image>\n b", 2),
    ]
    crops_seen = set()
    for text, n in prompts:
        for i in range(len(SIZES) - n + 1):
            imgs = [_img(SIZES[i + j], seed=10 * i + j) for j in range(n)]
            ids, feats = proc.process(hf.tokenizer(text)["input_ids"], imgs, mm_processor_kwargs=kwargs)
            want = hf(text=[text], images=imgs, return_tensors="pt", **(kwargs or {}))
            assert ids == want["input_ids"][0].tolist(), (text, [im.size for im in imgs])
            assert len(feats) == int(want["pixel_values"].shape[0])  # one feature per crop, originals included
            for f in feats:
                assert ids[f.offset - 1] == boi and ids[f.offset : f.end] == [soft] * 16 and f.length == 16
            assert sum(t == soft for t in ids) == 16 * len(feats)
            torch.testing.assert_close(torch.cat([f.data["pixel_values"] for f in feats]), want["pixel_values"])
            crops_seen.add(len(feats) - n)
    assert (max(crops_seen) > 2) == bool(kwargs)  # pan-and-scan did crop some images


def test_tokenizer_merges_newlines_next_to_runs(g3_dir):
    """Guard for the test above: the test tokenizer merges newline runs ("user\\n" + "\\n\\n" is not the ids of
    "user\\n" then "\\n\\n"), so matching HF there needs the text next to each run tokenized anew."""
    from vlserve.multimodal.processor import MultiModalProcessor

    proc = MultiModalProcessor.from_pretrained(g3_dir)
    tok = proc.hf_processor.tokenizer
    assert (
        tok("user\n\n\n", add_special_tokens=False)["input_ids"]
        != tok("user\n", add_special_tokens=False)["input_ids"] + tok("\n\n", add_special_tokens=False)["input_ids"]
    )


# ---- model -----------------------------------------------------------------------------------------------------------


def test_weights_load_from_both_layouts(g3_dir, tmp_path):
    """Every checkpoint tensor lands in a parameter with its value (the 4.57 layout the checkpoint is saved in, and
    the in-memory module layout `model.vision_tower.vision_model.*` ...)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from vlserve.models.capabilities import capabilities_of
    from vlserve.models.loader import load_model

    cfg = AutoConfig.from_pretrained(g3_dir)
    model = load_model(g3_dir, cfg, "float32", "cpu")
    assert type(model).__name__ == "Gemma3ForConditionalGeneration" and model.tied
    caps = capabilities_of(model)
    assert caps.bidirectional_token_id == cfg.image_token_index and caps.unsplit_mm_items
    params = dict(model.named_parameters())
    ckpt = load_file(os.path.join(g3_dir, "model.safetensors"))
    packed: dict[str, list] = {}  # the decoder's fused q/k/v and gate/up weights, from their pieces in order
    for name, t in ckpt.items():  # 4.57 writes the tower with `vision_model.`, 5.x without
        ours = name.replace("language_model.model.", "language_model.", 1).replace(".vision_model.", ".", 1)
        for piece, (fused, order) in PACKED.items():
            if ours.startswith("language_model.") and f".{piece}." in ours:
                packed.setdefault(ours.replace(piece, fused), []).append((order, t))
                break
        else:
            assert torch.equal(params.pop(ours), t), name
    for name, pieces in packed.items():
        assert torch.equal(params.pop(name), torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])])), name
    assert not params  # every parameter came from the checkpoint (lm_head is the tied embedding)
    module = {}  # the in-memory 5.x module layout
    for name, t in ckpt.items():
        name = name.replace("language_model.model.", "language_model.", 1)
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = "vision_tower.vision_model." + name[len("vision_tower.") :]
        module["model." + name] = t
    dst = str(tmp_path / "module_layout")
    shutil.copytree(g3_dir, dst)
    save_file(module, os.path.join(dst, "model.safetensors"))
    got = load_model(dst, cfg, "float32", "cpu").state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(t, got[name]), name


def test_tower_and_projector_match_hf(oracle):
    from vlserve.models.gemma3_mm import Gemma3ForConditionalGeneration

    hf = oracle.model
    ours = Gemma3ForConditionalGeneration(hf.config)
    ours.vision_tower.load_weights(hf.model.vision_tower.state_dict().items())
    ours.multi_modal_projector.load_state_dict(hf.model.multi_modal_projector.state_dict(), strict=True)
    ours.to(oracle.device)
    imgs = [_img(s, seed=i) for i, s in enumerate(SIZES)]
    pixels = oracle.processor.image_processor(images=imgs, return_tensors="pt")["pixel_values"].to(oracle.device)
    with torch.no_grad():
        want = _image_features(hf.model.get_image_features(pixel_values=pixels))  # [N, 16, H]
        got = ours.image_features(pixels)
    assert got.shape == want.shape == (len(SIZES), 16, hf.config.text_config.hidden_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_paged_logits_match_hf_with_bidirectional_images(g3_dir, oracle):
    """Prefill of a two-image prompt (image rows written over the soft tokens, key limits over each run) then decodes
    over the paged cache: logits equal HF's forward with token_type_ids (its bidirectional mask); a causal prefill
    does not."""
    from transformers import AutoConfig

    from tests.support.paged_runner import PagedRunner
    from vlserve.models.capabilities import capabilities_of
    from vlserve.models.loader import load_model
    from vlserve.worker.bidirectional import token_runs

    cfg = AutoConfig.from_pretrained(g3_dir)
    model = load_model(g3_dir, cfg, "float32", "cpu")
    text = oracle.text(2, "Compare them.")
    inputs = oracle.processor(text=[text], images=[_img(SIZES[0], 1), _img(SIZES[1], 2)], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    decodes = [5, 17, 42]
    with torch.no_grad():
        hf = oracle.model.to("cpu")
        full = torch.tensor([ids + decodes])
        types = torch.cat([inputs["token_type_ids"], torch.zeros(1, len(decodes), dtype=torch.long)], dim=1)
        want = hf(input_ids=full, pixel_values=inputs["pixel_values"], token_type_ids=types).logits[0].float()
        hf.to(oracle.device)
        feats = model.embed_multimodal("image", {"pixel_values": inputs["pixel_values"]})  # [2 * 16, H]
    soft = capabilities_of(model).bidirectional_token_id
    limits = list(range(len(ids)))
    for first, last in token_runs(ids, soft):
        limits[first : last + 1] = [last] * (last - first + 1)

    def logits(bidirectional: bool) -> torch.Tensor:
        def forward(input_ids, positions, kv_caches, md, inputs_embeds=None):
            if bidirectional and md.num_decodes == 0:
                md.key_limits = torch.tensor(limits)
            return model(input_ids, positions, kv_caches, md, inputs_embeds)

        runner = PagedRunner(model, cfg, block_size=4, forward=forward)
        embeds = model.get_input_embeddings(torch.tensor(ids))
        embeds[torch.tensor(ids) == soft] = feats
        out = [runner.step([("s", ids)], inputs_embeds={"s": embeds})["s"]]
        out += [runner.step([("s", [t])])["s"] for t in decodes]
        return torch.cat(out)

    torch.testing.assert_close(logits(True), want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits(False), want, rtol=1e-4, atol=1e-4)


# ---- engine ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", range(5), ids=["text_only", "one_image", "other_image", "two_images", "pan_and_scan"])
def test_generate_parity_with_hf(g3_dir, oracle, expected, llm_fixture, case):
    """The prompt ids and the greedy tokens equal HF's (image cases: HF's bidirectional mask over each run)."""
    out = _run(llm_fixture, [_cases(oracle)[case]])[0]
    hf_prompt, hf_new = expected[case]
    assert out.prompt_token_ids == hf_prompt
    assert list(out.outputs[0].token_ids) == hf_new


@pytest.fixture(scope="module")
def llm_fixture(g3_dir):
    return LLM(g3_dir, dtype="float32", num_kv_blocks=256)


def test_images_change_the_output_and_chat_matches(oracle, expected, llm_fixture):
    assert expected[1][1] != expected[2][1], "different images must give different outputs"
    url = data_url(_cases(oracle)[1][2][0])
    chat = llm_fixture.chat(
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
    assert list(chat[0].outputs[0].token_ids) == expected[1][1]
    llm_fixture.check_integrity()


def test_chunked_prefill_keeps_image_runs_whole(g3_dir, oracle, expected):
    """24-token steps: the scheduler cuts the prompts between runs, never inside one; outputs unchanged."""
    llm = LLM(g3_dir, dtype="float32", num_kv_blocks=64, block_size=16, max_num_batched_tokens=24)
    assert [list(o.outputs[0].token_ids) for o in _run(llm, _cases(oracle))] == [e[1] for e in expected]
    llm.check_integrity()


def test_prefix_caching_and_encoder_cache(g3_dir, oracle, expected):
    """The same prompts again: prefix hits (image blocks included) and no new encoder runs, same outputs."""
    llm = LLM(g3_dir, dtype="float32", num_kv_blocks=128, block_size=16)
    cases = _cases(oracle)[1:4]
    first = [list(o.outputs[0].token_ids) for o in _run(llm, cases)]
    runs = llm.get_metrics()["vlserve:encoder_runs_total"]
    again = [list(o.outputs[0].token_ids) for o in _run(llm, cases)]
    assert first == again == [e[1] for e in expected[1:4]]
    m = llm.get_metrics()
    assert m["vlserve:prefix_cache_hits_total"] > 0 and m["vlserve:encoder_runs_total"] == runs == 3
    img = _img((60, 90), seed=11)
    outs = llm.generate(
        [oracle.text(1, f"Question {i}?") for i in range(6)], _greedy(3), images=[[img]] * 6, use_tqdm=False
    )
    assert len(outs) == 6 and llm.get_metrics()["vlserve:encoder_runs_total"] == 4  # the same image: once
    llm.check_integrity()


@pytest.mark.slow
def test_tensor_parallel_2_matches_hf(g3_dir, oracle, expected):
    """The decoder sharded over 2 ranks (the tower replicated), 24-token steps: HF's tokens."""
    llm = LLM(g3_dir, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=24, tensor_parallel_size=2)
    try:
        assert [list(o.outputs[0].token_ids) for o in _run(llm, _cases(oracle))] == [e[1] for e in expected]
    finally:
        llm.shutdown()
