"""A multimodal model's pipeline stages, loaded in this process (the stage set by hand, as in
test_pipeline_stage_load.py): the encoder parts (tower, projector, LLaVA-NeXT's image_newline) only on the first stage,
nothing of them read by the others; the decoder split as for the text models, with the LM head on the last stage
(read from the embeddings when tied); Qwen3-VL and Gemma 3 refused with their reason."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.models.test_pipeline_stage_load import assert_stage_params_are_the_models, load_two_stages
from vlserve.models.llama import AbsentOnStage

ENCODER_PREFIXES = (
    "visual.",
    "model.visual.",
    "vision_tower.",
    "model.vision_tower.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
    "image_newline",
    "model.image_newline",
)


@pytest.fixture(scope="module")
def vl_ckpts(tmp_path_factory):
    from vlserve.demo.llava_checkpoints import build_llava_checkpoint
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    root = tmp_path_factory.mktemp("pp_vl")
    return {
        "qwen2_vl_tied": build_qwen2_vl_checkpoint(str(root / "q"), num_layers=4, tie_word_embeddings=True),
        "llava_next": build_llava_checkpoint(str(root / "n"), variant="llava_next", num_layers=4),
    }


@pytest.mark.parametrize("kind", ["qwen2_vl_tied", "llava_next"])
def test_encoder_parts_live_on_the_first_stage_only(vl_ckpts, kind, monkeypatch):
    stages = load_two_stages(vl_ckpts[kind], monkeypatch)
    last, p0, p1, read0, read1 = stages.last, stages.p0, stages.p1, stages.read0, stages.read1
    tower = "visual" if kind.startswith("qwen") else "vision_tower"
    assert any(n.startswith(tower + ".") for n in p0) and not any(n.startswith(tower + ".") for n in p1)
    assert isinstance(getattr(last, tower), AbsentOnStage)
    if kind == "llava_next":
        assert "image_newline" in p0 and "multi_modal_projector.linear_1.weight" in p0
        assert last.image_newline is None and isinstance(last.multi_modal_projector, AbsentOnStage)
    layers0 = {n.split(".")[2] for n in p0 if n.startswith("language_model.layers.")}
    layers1 = {n.split(".")[2] for n in p1 if n.startswith("language_model.layers.")}
    assert (layers0, layers1) == ({"0", "1"}, {"2", "3"})
    assert "language_model.embed_tokens.weight" in p0 and "lm_head.weight" not in p0
    assert "language_model.embed_tokens.weight" not in p1 and "lm_head.weight" in p1
    tied = kind == "qwen2_vl_tied"
    assert_stage_params_are_the_models(stages, "language_model.embed_tokens.weight", tied)
    assert not any(n.startswith(ENCODER_PREFIXES) for n in read1)
    assert any(n.startswith(ENCODER_PREFIXES) for n in read0)
    assert any(n.endswith("embed_tokens.weight") for n in read1) == tied  # the tied head's source only


def test_deepstack_and_gemma3_vlms_are_refused():
    from vlserve.engine.model_setup import check_pipeline_stages
    from vlserve.models.gemma3_mm import Gemma3ForConditionalGeneration
    from vlserve.models.qwen2_vl import Qwen2VLForConditionalGeneration
    from vlserve.models.qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    config = SimpleNamespace(text_config=SimpleNamespace(num_hidden_layers=4))
    check_pipeline_stages(Qwen2VLForConditionalGeneration, config, 2)
    for cls in (Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration):
        with pytest.raises(ValueError, match="does not support pipeline_parallel_size > 1 yet: its DeepStack"):
            check_pipeline_stages(cls, config, 2)
    with pytest.raises(ValueError, match="Gemma 3 decoder"):
        check_pipeline_stages(Gemma3ForConditionalGeneration, config, 2)
