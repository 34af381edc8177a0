"""The demo world's "json" form: its question and answer, DEMO_JSON_SCHEMA / fits_json_schema, and how eval scores
it (quick: no model, no training)."""

from __future__ import annotations

import json
import random

import pytest

from training import eval as demo_eval
from vlserve.demo import world


def _scene(*shapes):
    """A scene holding `shapes` ((kind, color, place), ...), in the order given (sample_scene sorts by kind)."""
    base = world.sample_scene(random.Random(0), num_shapes=1)
    return world.Scene(
        base.width,
        base.height,
        base.background,
        tuple(world.Shape(k, c, p, 10.0, 10.0, 5.0, 0.0, world.COLORS[c]) for k, c, p in shapes),
        base.style,
    )


def test_json_form_is_last_and_an_image_form():
    assert world.FORMS[-1] == "json" and world.FORMS.count("json") == 1
    assert world.FORMS[:8] == (
        "shape",
        "color",
        "count",
        "where",
        "describe",
        "direction",
        "moving_color",
        "describe_video",
    )
    assert "json" in world.IMAGE_FORMS and "json" not in world.VIDEO_FORMS
    assert world.QUESTION_TEMPLATES["json"] == "Describe the image as JSON."


def test_json_answer_text():
    scene = _scene(("circle", "red", "left"), ("triangle", "blue", "top"))
    assert world.answer(scene, "Describe the image as JSON.") == (
        '{"count": 2, "shapes": [{"shape": "circle", "color": "red"}, {"shape": "triangle", "color": "blue"}]}'
    )
    one = _scene(("square", "white", "center"))
    assert world.answer(one, "Describe the image as JSON.") == (
        '{"count": 1, "shapes": [{"shape": "square", "color": "white"}]}'
    )


def test_json_answer_follows_the_description_and_fits_the_schema():
    rng = random.Random(3)
    for _ in range(40):
        scene = world.sample_scene(rng)
        qas = [qa for qa in world.qas(scene) if qa[0] == "json"]
        assert len(qas) == 1
        _, q, a = qas[0]
        assert q == "Describe the image as JSON."
        value = json.loads(a)
        assert a == json.dumps(value)  # default separators ", " and ": "
        assert value["count"] == len(scene.shapes) == len(value["shapes"])
        desc = world.describe_image(scene)
        # same words and order as the description: "<color> <kind> at the <place>", shapes in its order
        positions = [desc.index(f"{s['color']} {s['shape']} at the") for s in value["shapes"]]
        assert positions == sorted(positions)
        assert world.fits_json_schema(a)
    assert not any(f == "json" for f, _, _ in world.qas(world.sample_video(rng)))


def test_sample_qa_gives_the_json_form():
    rng = random.Random(5)
    form, q, a = world.sample_qa(rng, world.sample_scene(rng), "json")
    assert form == "json" and q == "Describe the image as JSON." and world.fits_json_schema(a)


def test_schema_lists_the_worlds_words():
    s = world.DEMO_JSON_SCHEMA
    assert s["type"] == "object" and set(s["required"]) == {"count", "shapes"} and s["additionalProperties"] is False
    assert s["properties"]["count"]["type"] == "integer"
    item = s["properties"]["shapes"]["items"]
    assert set(item["required"]) == {"shape", "color"} and item["additionalProperties"] is False
    assert item["properties"]["shape"]["enum"] == list(world.SHAPES)
    assert item["properties"]["color"]["enum"] == list(world.COLORS)


VALID = [
    '{"count": 1, "shapes": [{"shape": "circle", "color": "red"}]}',
    '{"shapes": [], "count": 0}',
    '{"count":3,"shapes":[{"color":"black","shape":"square"},{"shape":"triangle","color":"orange"},'
    '{"shape":"circle","color":"purple"}]}',
]
INVALID = [
    "",
    "The image shows 1 shape: a red circle at the left.",
    '{"count": 1, "shapes": [',
    '{"count": "1", "shapes": []}',
    '{"count": 1.5, "shapes": []}',
    '{"count": true, "shapes": []}',
    '{"count": 1}',
    '{"shapes": []}',
    '{"count": 1, "shapes": [], "extra": 1}',
    '{"count": 1, "shapes": [{"shape": "hexagon", "color": "red"}]}',
    '{"count": 1, "shapes": [{"shape": "circle", "color": "pink"}]}',
    '{"count": 1, "shapes": [{"shape": "circle"}]}',
    '{"count": 1, "shapes": [{"shape": "circle", "color": "red", "place": "left"}]}',
    '{"count": 1, "shapes": {"shape": "circle", "color": "red"}}',
    "[1, 2]",
]


@pytest.mark.parametrize("checker", ["jsonschema", "fallback"])
def test_fits_json_schema(checker, monkeypatch):
    if checker == "fallback":  # the small checker used where the jsonschema package is missing
        import sys

        monkeypatch.setitem(sys.modules, "jsonschema", None)
    else:
        pytest.importorskip("jsonschema")
    for text in VALID:
        assert world.fits_json_schema(text), text
    for text in INVALID:
        assert not world.fits_json_schema(text), text


def test_eval_scores_json_by_parsed_value_and_schema():
    expected = '{"count": 2, "shapes": [{"shape": "circle", "color": "red"}, {"shape": "square", "color": "blue"}]}'
    item = {"form": "json", "question": "Describe the image as JSON.", "answer": expected}
    assert demo_eval.is_right(item, expected)
    assert demo_eval.is_right(item, " " + expected.replace(": ", ":").replace(", ", ",") + "\n")  # same value
    assert demo_eval.is_right(
        item, '{"shapes": [{"color": "red", "shape": "circle"}, {"shape": "square", "color": "blue"}], "count": 2}'
    )  # key order is free
    wrong = [
        '{"count": 2, "shapes": [{"shape": "square", "color": "blue"}, {"shape": "circle", "color": "red"}]}',
        '{"count": 3, "shapes": [{"shape": "circle", "color": "red"}, {"shape": "square", "color": "blue"}]}',
        '{"count": 2, "shapes": [{"shape": "circle", "color": "red"}]}',
        expected[:-1],
        "",
        expected.upper(),
    ]
    assert not any(demo_eval.is_right(item, w) for w in wrong)
    # the other forms keep the exact match (case and surrounding whitespace ignored)
    other = {"form": "count", "question": "How many shapes are there?", "answer": "There are 2 shapes."}
    assert demo_eval.is_right(other, " there are 2 shapes. ") and not demo_eval.is_right(other, "There are 2.")


def test_eval_score_reports_json_accuracy_and_validity():
    exp = world.json_answer(_scene(("circle", "red", "left")))
    items = [{"form": "json", "answer": exp}] * 4 + [{"form": "count", "answer": "There is 1 shape."}] * 2
    outs = [
        exp,  # right
        '{"count": 1, "shapes": [{"shape": "square", "color": "red"}]}',  # valid, wrong value
        '{"count": 1, "shapes": [{"shape": "circle", "color": "red"}',  # not JSON
        '{"count": 1, "shapes": [{"shape": "circle", "color": "crimson"}]}',  # JSON, outside the schema
        "There is 1 shape.",
        "There are 2 shapes.",
    ]
    acc = demo_eval.score(items, outs)
    assert acc["json"] == 0.25 and acc["json_valid"] == 0.5 and acc["count"] == 0.5
    assert acc["overall"] == 2 / 6
    assert "json_valid" not in demo_eval.score(items[4:], outs[4:])


def test_held_out_set_keeps_the_other_forms_items():
    """json is last in FORMS, so a seeded held-out set's items of the other forms are what they were without it."""
    items = demo_eval.held_out_set(per_form=2, seed=5)
    assert [it["form"] for it in items] == [f for f in world.FORMS for _ in range(2)]
    rng = random.Random(5)
    first = world.sample_scene(rng)
    assert items[0]["answer"] == world.sample_qa(rng, first, "shape")[2]
    assert all(it["kind"] == "image" for it in items if it["form"] == "json")


def test_training_weights_and_tokenizer_corpus():
    from training.tokenizer import corpus
    from training.train import FORM_WEIGHTS

    assert FORM_WEIGHTS["json"] == 1.5 and set(FORM_WEIGHTS) == set(world.FORMS)
    # the tokenizer's corpus leaves the json form out: the demo vocabulary stays the shipped one
    assert not any("as JSON" in line for line in corpus(num_scenes=30))


def test_copy_processor_files(tmp_path):
    from training.train import PROCESSOR_FILES, copy_processor_files
    from vlserve.demo import MODEL_DIR

    names = copy_processor_files(MODEL_DIR, str(tmp_path))
    assert "tokenizer.json" in names and "model.safetensors" not in names and set(names) <= set(PROCESSOR_FILES)
    for n in names:
        assert (tmp_path / n).read_bytes() == open(f"{MODEL_DIR}/{n}", "rb").read()
