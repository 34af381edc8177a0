"""`vlserve.engine.scoring`: the pairs and prompts a score call pools (1:N, N:N, vLLM's multimodal inputs, an
embedder's sides pooled once), its refusals, and `LLM.score` on a yes/no reranker with an image document equal to
classifying the chat message the plan renders by hand."""

from __future__ import annotations

import pytest
from PIL import Image

from tests.multimodal.mm_media import rand_image
from vlserve.engine.scoring import ChatPrompt, TextPairPrompt, TextPrompt, plan_scores, score_inputs

CLASSIFIER = {"classify", "score", "encode"}
EMBEDDER = {"embed", "encode"}
IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def test_sides_and_pairs():
    assert score_inputs("a", "q") == ["a"]
    assert score_inputs({"content": [IMAGE_PART, {"type": "text", "text": "t"}]}, "d") == [
        [IMAGE_PART],
        [{"type": "text", "text": "t"}],
    ]  # vLLM's ScoreMultiModalParam: each part is an input
    assert score_inputs(["a", {"content": [IMAGE_PART]}], "d") == ["a", [IMAGE_PART]]
    plan = plan_scores("q", ["a", {"content": [IMAGE_PART]}], CLASSIFIER)
    assert plan.task == "score" and plan.pairs == [(0,), (1,)]
    assert plan.prompts[0] == TextPairPrompt("q", "a")
    assert plan.prompts[1] == ChatPrompt(({"type": "text", "text": "q"}, IMAGE_PART))
    plan = plan_scores("q", ["a", "q", "a"], EMBEDDER)
    assert plan.task == "embed" and plan.prompts == [TextPrompt("q"), TextPrompt("a")]
    assert plan.pairs == [(0, 1), (0, 0), (0, 1)]
    plan = plan_scores(["x", "y"], [{"content": [IMAGE_PART]}, "z"], EMBEDDER)
    assert plan.prompts == [TextPrompt("x"), ChatPrompt((IMAGE_PART,)), TextPrompt("y"), TextPrompt("z")]
    assert plan.pairs == [(0, 1), (2, 3)]


@pytest.mark.parametrize(
    "data_1, data_2, tasks, words",
    [
        (["a", "b"], ["c", "d", "e"], CLASSIFIER, "1:N or N:N"),
        ("a", [], CLASSIFIER, "data_2 must not be empty"),
        ("a", 3, CLASSIFIER, "data_2 must be a string"),
        ("a", [3], CLASSIFIER, r"data_2\[0\]"),
        ("a", {"content": []}, CLASSIFIER, "content must be a non-empty list"),
        ("a", {"content": [IMAGE_PART], "role": "user"}, CLASSIFIER, "unknown keys"),
        ("a", "b", set(), "does not score"),
    ],
)
def test_bad_sides_are_value_errors(data_1, data_2, tasks, words):
    with pytest.raises(ValueError, match=words):
        plan_scores(data_1, data_2, tasks)


def test_reranker_image_document_equals_its_chat_prompt(tmp_path):
    import base64
    import io

    from transformers import AutoTokenizer

    from vlserve import LLM
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    model_dir = build_qwen2_vl_checkpoint(str(tmp_path / "qwen2_vl"), variant="qwen2_vl")
    no_token, yes_token = AutoTokenizer.from_pretrained(model_dir).convert_ids_to_tokens([101, 202])
    llm = LLM(
        model_dir,
        dtype="float32",
        num_kv_blocks=128,
        convert="classify",
        pooler_config={"classifier_from_token": [no_token, yes_token]},
    )
    try:
        img = Image.fromarray(rand_image(56, 84, seed=4))
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        part = {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()},
        }
        scores = llm.score("is it a cat?", ["a cat", {"content": [part]}], use_tqdm=False)
        message = [{"role": "user", "content": [{"type": "text", "text": "is it a cat?"}, part]}]
        by_hand = llm.classify([message], use_tqdm=False)[0]  # a conversation, with a generation prompt
        assert abs(scores[1].outputs.score - by_hand.outputs.probs[0]) < 1e-6
        assert scores[1].prompt_token_ids == by_hand.prompt_token_ids
        pair = llm.tokenizer("is it a cat?", "a cat")["input_ids"]
        assert scores[0].prompt_token_ids == pair
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_is_dual_tower():
    from transformers import CLIPConfig, Qwen2Config

    from vlserve.engine.scoring import is_dual_tower

    assert is_dual_tower(CLIPConfig(architectures=["CLIPModel"]))
    assert not is_dual_tower(Qwen2Config(architectures=["Qwen2ForCausalLM"]))
