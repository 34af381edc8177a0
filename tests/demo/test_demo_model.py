"""The shipped demo checkpoint: a standard HF directory, the default model, HF == vlserve, and a quick held-out eval."""

import os

import pytest

from training import eval as demo_eval
from vlserve.demo import EAGLE_DIR, MODEL_DIR, default_draft_path, default_model_path
from vlserve.spec_decode.config import fill_default_draft

pytestmark = [pytest.mark.slow, pytest.mark.hf_parity]  # hf_parity: also run on transformers 4.57


@pytest.fixture(scope="module")
def llm():
    from vlserve import LLM

    return LLM()  # no model: the embedded demo


def test_shipped_checkpoint_is_small_and_standard():
    assert default_model_path() == MODEL_DIR
    total = sum(
        os.path.getsize(os.path.join(MODEL_DIR, f))
        for f in os.listdir(MODEL_DIR)
        if os.path.isfile(os.path.join(MODEL_DIR, f))
    )
    assert total <= 25 * 1024 * 1024, f"demo checkpoint is {total / 2**20:.1f} MiB"
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(MODEL_DIR, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(MODEL_DIR, local_files_only=True)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert processor.tokenizer.chat_template, "the chat template ships with the tokenizer"


def test_llm_without_model_uses_the_demo(llm):
    assert os.path.realpath(llm.engine.loaded.model_path) == os.path.realpath(MODEL_DIR)
    items = demo_eval.held_out_set(per_form=1, seed=7)
    out = llm.chat([demo_eval.messages_for(it, "vlserve") for it in items[:2]], use_tqdm=False)
    assert all(o.outputs[0].text for o in out)


def test_quick_eval_through_vlserve(llm):
    """A few dozen fresh held-out items (every form), asked through vlserve: >= 0.9 exact-match accuracy."""
    from vlserve import SamplingParams

    items = demo_eval.held_out_set(per_form=5, seed=demo_eval.EVAL_SEED + 1)
    outs = llm.chat(
        [demo_eval.messages_for(it, "vlserve") for it in items],
        SamplingParams(temperature=0.0, max_tokens=demo_eval.MAX_NEW_TOKENS),
        use_tqdm=False,
    )
    acc = demo_eval.score(items, [o.outputs[0].text for o in outs])
    assert acc["overall"] >= 0.9, acc


def test_json_schema_answers_about_pictures_are_valid_and_right(llm):
    """A JSON-schema request about a picture (count, shapes, colours) gets valid JSON with the right values."""
    import json

    from PIL import Image

    from vlserve import SamplingParams, StructuredOutputsParams
    from vlserve.demo import world

    sp = SamplingParams(
        temperature=0.0,
        max_tokens=demo_eval.MAX_NEW_TOKENS,
        structured_outputs=StructuredOutputsParams(json=world.DEMO_JSON_SCHEMA),
    )
    items = [it for it in demo_eval.held_out_set(per_form=8, seed=demo_eval.EVAL_SEED + 2) if it["form"] == "json"]
    outs = llm.chat([demo_eval.messages_for(it, "vlserve") for it in items], sp, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(world.fits_json_schema(t) for t in texts), texts
    right = [json.loads(t) == json.loads(it["answer"]) for t, it in zip(texts, items)]
    assert sum(right) >= len(items) - 1, list(zip(texts, [it["answer"] for it in items]))
    # the README's picture: a yellow square and a red triangle
    picture = Image.open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "demo_image.png")).convert("RGB")
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": picture},
                {"type": "text", "text": "Describe the image as JSON."},
            ],
        }
    ]
    out = json.loads(llm.chat(msgs, sp, use_tqdm=False)[0].outputs[0].text)
    assert out == {
        "count": 2,
        "shapes": [{"shape": "square", "color": "yellow"}, {"shape": "triangle", "color": "red"}],
    }, out


def test_hf_and_vlserve_give_identical_greedy_answers(llm):
    from vlserve import SamplingParams

    items = demo_eval.held_out_set(per_form=1, seed=11)  # one image or clip per form
    hf = demo_eval.generate_hf(MODEL_DIR, items, batch_size=4)
    outs = llm.chat(
        [demo_eval.messages_for(it, "vlserve") for it in items],
        SamplingParams(temperature=0.0, max_tokens=demo_eval.MAX_NEW_TOKENS),
        use_tqdm=False,
    )
    assert [o.outputs[0].text.strip() for o in outs] == [h.strip() for h in hf]


def test_default_eagle_head_is_used_and_exact(llm):
    """`{"method": "eagle"}` with no draft on the demo model loads the shipped head; greedy output is unchanged."""
    from vlserve import LLM, SamplingParams

    assert default_draft_path(MODEL_DIR) == EAGLE_DIR
    assert fill_default_draft({"method": "eagle", "num_speculative_tokens": 4}, MODEL_DIR)["model"] == EAGLE_DIR
    assert fill_default_draft({"method": "eagle", "num_speculative_tokens": 4}, "/elsewhere").get("model") is None
    items = [it for it in demo_eval.held_out_set(per_form=1, seed=5) if it["form"].startswith("describe")]
    msgs = [demo_eval.messages_for(it, "vlserve") for it in items]
    params = SamplingParams(temperature=0.0, max_tokens=demo_eval.MAX_NEW_TOKENS)
    plain = [o.outputs[0].text for o in llm.chat(msgs, params, use_tqdm=False)]
    spec = LLM(speculative_config={"method": "eagle", "num_speculative_tokens": 4})
    assert [o.outputs[0].text for o in spec.chat(msgs, params, use_tqdm=False)] == plain
    m = spec.get_metrics()
    drafts, accepted = m["vlserve:spec_decode_num_drafts_total"], m["vlserve:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and accepted / drafts > 1.0, m  # the trained head gets more than one token right per draft


def test_server_uses_the_shipped_eagle_head_without_a_draft_path(llm):
    """`vlserve serve --speculative-config '{"method": "eagle", ...}'` with no draft: same answers, drafts proposed."""
    from tests.api.conftest import start_server
    from vlserve import SamplingParams
    from vlserve.config import EngineArgs

    served = start_server(EngineArgs(model=None, speculative_config='{"method": "eagle", "num_speculative_tokens": 4}'))
    try:
        assert served.engine.engine.spec_config.model == EAGLE_DIR
        item = demo_eval.held_out_set(per_form=1, seed=5)[4]
        assert item["question"] == "Describe the image."
        import base64
        import io

        buf = io.BytesIO()
        item["media"].save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        reply = served.client.chat.completions.create(
            model=served.model,
            max_tokens=48,
            temperature=0,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": item["question"]},
                    ],
                }
            ],
        )
        m = served.wait_idle()
        assert m["vlserve:spec_decode_num_drafts_total"] > 0
        plain = (
            llm.chat(
                demo_eval.messages_for(item, "vlserve"), SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False
            )[0]
            .outputs[0]
            .text
        )
        assert reply.choices[0].message.content == plain
    finally:
        served.close()
