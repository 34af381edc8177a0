"""The demo trainer's pieces: dense targets, silhouettes, the EAGLE data file, and a two-stage smoke run."""

import json
import math
import os
import random

import numpy as np
import pytest

from training import targets
from training.vision_stage import SUB, patch_silhouettes
from vlserve.demo import world


def test_silhouette_area_matches_the_shape():
    scene = world.sample_scene(random.Random(3), num_shapes=1)
    grid = (1, 12, 12)  # 168 x 168 px after the processor's resize
    sil = patch_silhouettes(scene, grid)
    assert sil.shape == (144, SUB * SUB) and sil.min() >= 0 and sil.max() <= 1
    s = scene.shapes[0]
    scale = 168 / scene.width
    area = {
        "circle": math.pi * s.r**2,
        "square": (1.7 * s.r) ** 2,
        "triangle": 3 * math.sqrt(3) / 4 * (1.1 * s.r) ** 2,
    }[s.kind] * scale**2
    assert sil.sum() * (14 / SUB) ** 2 == pytest.approx(area, rel=0.08)


def test_silhouette_patch_order_follows_the_merger():
    """Patches come in (row-block, col-block, 2x2) order: the shape's patches belong to the cells labeled with it."""
    scene = world.sample_scene(random.Random(8), num_shapes=1)
    sil = patch_silhouettes(scene, (1, 12, 12))  # [144, 49]
    per_cell = sil.reshape(36, 4 * SUB * SUB).sum(1)  # 4 consecutive patches = one merged cell
    labels = targets.scene_targets(scene, (1, 12, 12))
    assert labels["kind"][int(np.argmax(per_cell))] == targets.KIND_INDEX[scene.shapes[0].kind]


def test_video_targets_and_silhouettes_follow_the_motion():
    clip = world.sample_video(random.Random(4), num_frames=8)
    grid = (4, 8, 8)
    labels = targets.scene_targets(clip, grid)
    assert len(labels["kind"]) == 4 * 16
    direction = world.DIRECTIONS.index(clip.direction)
    assert {m for m, k in zip(labels["motion"], labels["kind"]) if k} == {direction}
    assert all(m == targets.IGNORE for m, k in zip(labels["motion"], labels["kind"]) if not k)
    sil = patch_silhouettes(clip, grid).reshape(4, 64, SUB * SUB).sum(-1)  # [groups, patches]
    assert (sil.sum(1) > 0).all()
    first, last = (int(np.argmax(g)) for g in (sil[0], sil[-1]))
    assert first != last, "the shape moved between the first and the last frame pair"


def test_cell_losses_ignore_the_background_for_kind_and_color():
    import torch

    kind, color = torch.tensor([0, 1, 3]), torch.tensor([0, 2, 5])
    motion = torch.full((3,), targets.IGNORE)
    logits = torch.zeros(3, targets.NUM_CELL_OUTPUTS)
    base = targets.cell_losses(logits, kind, color, motion)
    assert set(base) == {"presence", "kind", "color"}
    logits[0, 1:] = 50.0  # garbage on the background cell's kind/color outputs changes nothing but presence
    changed = targets.cell_losses(logits, kind, color, motion)
    assert changed["kind"] == base["kind"] and changed["color"] == base["color"]


def test_eagle_data_items_are_chat_jsonl(tmp_path):
    from training import eagle_data

    out = tmp_path / "d.jsonl"
    eagle_data.main(["--out", str(out), "--num", "4", "--seed", "1"])
    items = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(items) == 4
    for it in items:
        (msg,) = it["messages"]
        media, text = msg["content"]
        assert media["type"] in ("image_url", "video_url")
        assert media[media["type"]]["url"].startswith(("data:image/png;base64,", "data:video/mp4;base64,"))
        assert text["type"] == "text" and text["text"].endswith(("?", "."))


@pytest.mark.slow
def test_two_stage_training_smoke(tmp_path):
    """A few steps of each stage write a checkpoint that transformers loads unchanged."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from training.train import train

    out = str(tmp_path / "ckpt")
    summary = train(out, steps=3, batch_size=2, vision_steps=2, workers=0, log_every=1, warmup=1)
    assert summary["vision_stage"]["steps"] == 2 and summary["steps"] == 3
    assert math.isfinite(summary["final_loss"])
    AutoProcessor.from_pretrained(out, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(out, local_files_only=True)
    from vlserve.models.hf_config import rope_params_of

    assert rope_params_of(model.config.text_config).theta == 10.0 and os.path.isfile(
        os.path.join(out, "model.safetensors")
    )


def test_linear_patch_embed_matches_the_conv3d_and_restores():
    """Training's Linear patch embedding computes the Conv3d's result; restoring brings the module's forward back."""
    import torch

    from training.build import DemoSize, build_config, build_model, build_processor
    from training.tokenizer import build_demo_tokenizer
    from training.train import linear_patch_embed

    tokenizer = build_demo_tokenizer()
    model = build_model(build_config(tokenizer, DemoSize(vision_depth=1)), seed=0)
    image = world.render_image(world.sample_scene(random.Random(5)))
    pixels = build_processor(tokenizer).image_processor(images=[image], return_tensors="pt")["pixel_values"]
    pe = model.model.visual.patch_embed
    with torch.no_grad():
        conv = pe(pixels)  # [P, embed_dim]
        restore = linear_patch_embed(model)
        linear = pe(pixels)
        restore()
        again = pe(pixels)
    assert conv.shape == linear.shape and conv.abs().max() > 0
    torch.testing.assert_close(linear, conv, rtol=1e-4, atol=1e-5)
    assert "forward" not in pe.__dict__ and torch.equal(again, conv)


def test_turns_that_name_a_kind_or_color_come_last():
    """No training conversation asks a naming question (which gives away a kind or color) before another form."""
    from training.train import NAMING_FORMS, render_sample

    rng = random.Random(3)
    seen_mixed = 0
    for i in range(60):
        _, _, turns, _ = render_sample(rng, is_video=i % 2 == 1, max_turns=5)
        naming = [t[0] in NAMING_FORMS for t in turns]
        assert naming == sorted(naming)  # False (other forms) before True
        seen_mixed += 0 < sum(naming) < len(naming)
    assert seen_mixed > 5


def test_batches_hold_one_media_kind():
    """A training batch is all images or all clips (so image batches are not padded to a clip's length)."""
    from training.build import build_processor
    from training.tokenizer import build_demo_tokenizer
    from training.train import make_batch

    processor = build_processor(build_demo_tokenizer())
    rng = random.Random(0)
    kinds = []
    for _ in range(6):
        batch = make_batch(rng, processor, 3, video_prob=0.5, max_turns=2)
        has_images, has_videos = "pixel_values" in batch, "pixel_values_videos" in batch
        assert has_images != has_videos
        kinds.append(has_videos)
    assert any(kinds) and not all(kinds)


def test_eager_attention_only_in_one_layer_matches_full_eager():
    """SDPA everywhere but the pointer layer gives the same loss and that layer's attention probabilities."""
    import torch

    from training.build import DemoSize, build_config, build_model, build_processor
    from training.tokenizer import build_demo_tokenizer
    from training.train import eager_attention_only_in, make_batch

    tokenizer = build_demo_tokenizer()
    processor = build_processor(tokenizer)
    model = build_model(build_config(tokenizer, DemoSize(vision_depth=1, num_layers=3)), seed=0).eval()
    batch = make_batch(random.Random(2), processor, 3, video_prob=0.0, max_turns=3)
    inputs = {k: v for k, v in batch.items() if not k.startswith(("aux_", "meta_"))}
    with torch.no_grad():
        model.set_attn_implementation("eager")
        full = model(**inputs, output_attentions=True)
        captured, restore = eager_attention_only_in(model, layer=1)
        mixed = model(**inputs)
        restore()
        model(**inputs)  # the hook is gone: nothing more is captured
    assert captured["probs"].shape == full.attentions[1].shape
    torch.testing.assert_close(captured["probs"], full.attentions[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mixed.loss, full.loss, rtol=1e-4, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"
    assert all(lyr.self_attn.config is model.config.text_config for lyr in model.model.language_model.layers)


def test_lr_schedule_follows_the_clock_only_when_it_is_ahead():
    from training.schedule import lr_at, schedule_step

    assert schedule_step(100, 1000, elapsed=60.0, minutes=None) == 100  # no cap: the steps alone
    assert schedule_step(100, 1000, elapsed=60.0, minutes=10.0) == 100  # 10% of the steps, 10% of the time
    assert schedule_step(1, 1000, elapsed=20.0, minutes=10.0) == 1  # a slow start does not move the schedule
    assert schedule_step(100, 1000, elapsed=300.0, minutes=10.0) == 450  # half the time gone: (nearly) half-way
    assert schedule_step(100, 1000, elapsed=900.0, minutes=10.0) == 1000  # past the cap: fully decayed
    assert lr_at(schedule_step(10, 1000, elapsed=599.0, minutes=10.0), 1000, 1.0, warmup=5) < 0.06


def test_training_is_reproducible(tmp_path):
    """The same arguments (a wall-clock cap included, which this run stays well inside) give the same weights."""
    import torch
    from safetensors.torch import load_file

    from training.train import train

    runs = []
    for name in ("a", "b"):
        out = str(tmp_path / name)
        train(out, steps=3, batch_size=2, vision_steps=2, workers=0, log_every=1, warmup=1, minutes=40.0)
        runs.append(load_file(os.path.join(out, "model.safetensors")))
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
