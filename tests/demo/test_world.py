"""Quick unit tests for the demo world: scene sampling, rendering, and question/answer generation."""

from __future__ import annotations

import math
import random
import re

import pytest

from vlserve.demo import world


def _scenes(n=60, seed=0):
    rng = random.Random(seed)
    return [world.sample_scene(rng) for _ in range(n)]


def _videos(n=30, seed=0):
    rng = random.Random(seed)
    return [world.sample_video(rng) for _ in range(n)]


def test_sampling_is_seeded():
    assert _scenes(10, seed=3) == _scenes(10, seed=3)
    assert _scenes(10, seed=3) != _scenes(10, seed=4)
    assert _videos(5, seed=3) == _videos(5, seed=3)


def test_scene_invariants():
    for sc in _scenes(200):
        assert world.MIN_SIDE <= sc.width <= world.MAX_SIDE and sc.width == sc.height  # square: a fixed token grid
        assert 1 <= len(sc.shapes) <= 3
        kinds = [s.kind for s in sc.shapes]
        assert kinds == sorted(kinds, key=world.SHAPES.index) and len(set(kinds)) == len(kinds)
        assert len({s.color for s in sc.shapes}) == len(sc.shapes)
        assert len({s.place for s in sc.shapes}) == len(sc.shapes)
        for s in sc.shapes:  # the center stays near its named place
            px, py = world.PLACE_XY[s.place]
            assert abs(s.cx / sc.width - px) <= 0.05 and abs(s.cy / sc.height - py) <= 0.05
        for i, a in enumerate(sc.shapes):  # shapes never overlap
            for b in sc.shapes[i + 1 :]:
                assert math.dist((a.cx, a.cy), (b.cx, b.cy)) > a.r + b.r


def test_video_invariants():
    for v in _videos(100):
        assert world.MIN_FRAMES <= v.num_frames <= world.MAX_FRAMES
        (x0, y0), (x1, y1) = v.centers[0], v.centers[-1]
        dx, dy = world.DIRECTION_XY[v.direction]
        side = v.width if dx else v.height
        travel = min(0.25, world.VIDEO_MAX_STEP * (v.num_frames - 1)) - 1e-6
        assert (x1 - x0) * dx + (y1 - y0) * dy >= travel * side
        for (ax, ay), (bx, by) in zip(v.centers, v.centers[1:]):  # each step moves the same way, and not too far
            assert 0 < (bx - ax) * dx + (by - ay) * dy <= (world.VIDEO_MAX_STEP + 1e-6) * side
        assert abs((x1 - x0) * dy) < 1e-6 and abs((y1 - y0) * dx) < 1e-6  # moves along one axis only
        m = world.VIDEO_MARGIN - 1e-9
        for cx, cy in v.centers:  # the whole shape stays (about) inside the frame
            assert m * v.width <= cx <= (1 - m) * v.width and m * v.height <= cy <= (1 - m) * v.height


def test_render_image_deterministic_and_sized():
    sc = _scenes(5, seed=1)[-1]
    a, b = world.render_image(sc), world.render_image(sc)
    assert a.size == (sc.width, sc.height) and a.mode == "RGB"
    assert a.tobytes() == b.tobytes()


def test_render_image_shows_shape_color():
    rng = random.Random(7)
    for _ in range(10):
        sc = world.sample_scene(rng, num_shapes=1)
        s = sc.shapes[0]
        px = world.render_image(sc).getpixel((int(s.cx), int(s.cy)))  # the center pixel is the shape's color
        assert math.dist(px, world.COLORS[s.color]) < 80, (px, s.color, sc.style)


def test_render_video_frames_move():
    v = world.sample_video(random.Random(2), num_frames=6)
    frames = world.render_video(v)
    assert len(frames) == 6 and all(f.size == (v.width, v.height) for f in frames)
    assert frames[0].tobytes() != frames[-1].tobytes()
    x, y = v.centers[-1]
    assert math.dist(frames[-1].getpixel((int(x), int(y))), world.COLORS[v.shape.color]) < 80


def test_write_mp4(tmp_path):
    av = pytest.importorskip("av")
    v = world.sample_video(random.Random(4), num_frames=4)
    path = world.write_mp4(world.render_video(v), str(tmp_path / "clip.mp4"))
    with av.open(path) as c:
        assert sum(1 for _ in c.decode(video=0)) == 4


def test_every_question_form_covered():
    forms = set()
    for sc in _scenes(30) + _videos(10):
        forms |= {f for f, _, _ in world.qas(sc)}
    assert forms == set(world.FORMS)


def test_image_answers():
    rng = random.Random(11)
    for _ in range(50):
        sc = world.sample_scene(rng)
        n = len(sc.shapes)
        assert world.answer(sc, "How many shapes are there?") == (
            "There is 1 shape." if n == 1 else f"There are {n} shapes."
        )
        shape_ans = world.answer(sc, "What shape is in the image?")
        assert all(s.kind in shape_ans for s in sc.shapes)
        desc = world.answer(sc, "Describe the image.")
        assert str(n) in desc
        for s in sc.shapes:
            assert world.answer(sc, f"What color is the {s.kind}?") == f"The {s.kind} is {s.color}."
            assert (
                world.answer(sc, f"Where is the {s.color} {s.kind}?") == f"The {s.color} {s.kind} is at the {s.place}."
            )
            assert f"{s.color} {s.kind} at the {s.place}" in desc


def test_video_answers():
    for v in _videos(20):
        s = v.shape
        assert world.answer(v, f"Which direction does the {s.kind} move?") == f"The {s.kind} moves {v.direction}."
        assert world.answer(v, "What color is the moving shape?") == f"The moving shape is {s.color}."
        desc = world.answer(v, "Describe the video.")
        assert s.color in desc and s.kind in desc and v.direction in desc


def test_questions_use_exact_templates():
    pattern = {
        f: re.escape(t)
        .replace(r"\{shape\}", "(circle|square|triangle)")
        .replace(r"\{color\}", "(" + "|".join(world.COLORS) + ")")
        for f, t in world.QUESTION_TEMPLATES.items()
    }
    for sc in _scenes(20) + _videos(10):
        for f, q, a in world.qas(sc):
            assert re.fullmatch(pattern[f], q), (f, q)
            if f == "json":  # a JSON object (tests/demo/test_json_form.py)
                assert a.startswith('{"count": ') and a.endswith("]}")
            else:
                assert a.endswith(".") and a[0].isupper()


def test_unknown_question_raises():
    sc = world.sample_scene(random.Random(0), num_shapes=1)
    absent = next(k for k in world.SHAPES if k != sc.shapes[0].kind)
    with pytest.raises(ValueError):
        world.answer(sc, f"What color is the {absent}?")
    with pytest.raises(ValueError):
        world.answer(sc, "What is the meaning of life?")


def test_sample_qa_respects_form():
    rng = random.Random(5)
    sc, v = world.sample_scene(rng), world.sample_video(rng)
    for form in world.IMAGE_FORMS:
        assert world.sample_qa(rng, sc, form)[0] == form
    for form in world.VIDEO_FORMS:
        assert world.sample_qa(rng, v, form)[0] == form


def test_description_length():
    for sc in _scenes(30):
        words = world.describe_image(sc).split()
        assert 7 <= len(words) <= 30
