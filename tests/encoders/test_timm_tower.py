"""The timm-built vision tower: buffers after a meta-device build, weight loading by timm's names (both spellings
of a PerceptionLM checkpoint), config errors, and a second timm backbone served with no new tower code."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tests.multimodal.mm_media import rand_image
from vlserve.encoders.timm_tower import TimmVisionTower, timm_tower_args

PE_ARGS = dict(embed_dim=32, depth=2, num_heads=2, img_size=32, patch_size=8, global_pool="", ref_feat_shape=(4, 4))


def _meta_built(architecture: str, model_args: dict) -> TimmVisionTower:
    with torch.device("meta"):
        tower = TimmVisionTower(architecture, model_args)
    tower.to_empty(device="cpu")
    for buf in tower.buffers():
        buf.fill_(float("nan"))  # what uninitialised memory may hold
    tower.init_buffers(torch.device("cpu"))
    return tower


@pytest.mark.parametrize("timm_hook", [True, False], ids=["timm-init-hook", "reference-copy"])
def test_meta_built_tower_recomputes_non_persistent_buffers(monkeypatch, timm_hook):
    from timm.layers import pos_embed_sincos

    if not timm_hook:  # a module whose computed buffers timm cannot rebuild in place
        monkeypatch.delattr(pos_embed_sincos._RotaryEmbeddingBase, "init_non_persistent_buffers")
    ref = TimmVisionTower("vit_pe_core_tiny_patch16_384", PE_ARGS)
    tower = _meta_built("vit_pe_core_tiny_patch16_384", PE_ARGS)
    names = tower._non_persistent_buffers()
    assert names, "the PE tower keeps its RoPE tables in non-persistent buffers"
    ref_bufs, bufs = dict(ref.timm_model.named_buffers()), dict(tower.timm_model.named_buffers())
    for n in names:
        torch.testing.assert_close(bufs[n], ref_bufs[n], rtol=0, atol=0)
    tower.load_weights(ref.timm_model.state_dict().items())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(tower(x), ref(x), rtol=0, atol=0)  # [2, 17, 32]


def test_load_weights_rejects_unknown_and_mis_shaped_names():
    tower = TimmVisionTower("vit_pe_core_tiny_patch16_384", PE_ARGS)
    with pytest.raises(ValueError, match="unexpected vision tower weight 'head.weight'"):
        tower.load_weights([("head.weight", torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="norm.weight.*shape"):
        tower.load_weights([("norm.weight", torch.zeros(5))])


def test_config_errors():
    with pytest.raises(ValueError, match="architecture"):
        timm_tower_args({"model_args": {}})
    with pytest.raises(ValueError, match="features_only"):
        timm_tower_args({"architecture": "resnet18", "model_args": {"features_only": True}})
    with pytest.raises(ValueError, match="no_such_net"):
        TimmVisionTower("no_such_net", {})


@pytest.fixture(scope="module")
def plm_dir(tmp_path_factory):
    from tests.support.plm_checkpoints import build_plm_checkpoint

    return build_plm_checkpoint(str(tmp_path_factory.mktemp("plm_tower")))


def _renamed(name: str) -> str:
    """The other spelling of PerceptionLM weight names (vision/projector at the top, decoder under .model)."""
    for new, old in (
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
    ):
        if name.startswith(new):
            return old + name[len(new) :]
    return name


def test_perception_lm_loads_both_weight_spellings(plm_dir):
    from transformers import AutoConfig

    from vlserve.models.loader import iter_safetensors_weights
    from vlserve.models.perception_lm import PerceptionLMForConditionalGeneration

    cfg = AutoConfig.from_pretrained(plm_dir)
    a, b = PerceptionLMForConditionalGeneration(cfg), PerceptionLMForConditionalGeneration(cfg)
    weights = list(iter_safetensors_weights(plm_dir))
    a.load_weights(weights)
    b.load_weights([(_renamed(n), t) for n, t in weights])
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
    dropped = [(n, t) for n, t in weights if not n.endswith("linear_2.bias")]
    with pytest.raises(ValueError, match="missing 1 weights.*linear_2.bias"):
        PerceptionLMForConditionalGeneration(cfg).load_weights(dropped)


@pytest.mark.hf_parity
def test_plain_vit_backbone_serves_with_hf_parity(tmp_path):
    """Another timm architecture (a plain ViT, no RoPE) behind the same PerceptionLM code: token-exact with HF."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from tests.support.hf_generate import hf_greedy_ignoring_eos
    from tests.support.plm_checkpoints import build_plm_checkpoint
    from vlserve import LLM, SamplingParams

    model_dir = build_plm_checkpoint(str(tmp_path / "plm_vit"), architecture="vit_tiny_patch16_224")
    proc = AutoProcessor.from_pretrained(model_dir)
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    img = Image.fromarray(rand_image(50, 150, seed=3))
    text = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    inputs = proc(text=[text], images=[img], return_tensors="pt")
    inputs.pop("token_type_ids", None)
    expected = hf_greedy_ignoring_eos(hf, inputs, 6)[0, inputs["input_ids"].shape[1] :].tolist()
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64)
    assert type(llm.engine.loaded.model.vision_tower.timm_model).__name__ == "VisionTransformer"
    out = llm.generate(
        {"prompt": text, "multi_modal_data": {"image": img}},
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )
    assert out[0].outputs[0].token_ids == expected
