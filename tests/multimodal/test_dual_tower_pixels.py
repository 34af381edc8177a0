"""A dual-tower image's pixels leave PIL once (`DualTowerProcessor.process_image`): the mm_hash and the pixel_values
equal what the generic `MultiModalProcessor.process_image` gives for the same image (RGB, 3 rows high, grayscale,
RGBA), with each family's fast and slow image processor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tests.support.dual_tower_checkpoints import build_checkpoint
from vlserve.multimodal.dual_tower_items import DualTowerProcessor
from vlserve.multimodal.hashing import hash_mm_item, hash_pil_pixels
from vlserve.multimodal.media import load_image
from vlserve.multimodal.processor import MultiModalProcessor


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    rgb = lambda h, w: rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)  # noqa: E731
    return [
        Image.fromarray(rgb(40, 50)),
        Image.fromarray(rgb(3, 20)),  # 3 rows high: passed to HF with its layout stated
        Image.fromarray(rgb(37, 29)).convert("L"),
        Image.fromarray(np.dstack([rgb(30, 30), rng.integers(0, 256, size=(30, 30), dtype=np.uint8)])),  # RGBA
    ]


@pytest.fixture(scope="module", params=["clip", "siglip"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_checkpoint(request.param, path)
    return str(path)


@pytest.mark.parametrize("use_fast", [True, False])
def test_pixels_and_hash_equal_the_generic_path(checkpoint, use_fast):
    proc = DualTowerProcessor.from_pretrained(checkpoint, use_fast, text_padding_length=None, check_text_ids=print)
    for img in _images():
        proc.clear_cache()
        ours_hash, ours = proc.process_image(img, {})
        proc.clear_cache()
        ref_hash, ref = MultiModalProcessor.process_image(proc, img, {})
        assert ours_hash == ref_hash == hash_mm_item("image", load_image(img), {})
        assert ours.keys() == ref.keys() == {"pixel_values"}
        assert torch.equal(ours["pixel_values"], ref["pixel_values"])


def test_hash_pil_pixels_equals_the_pil_image_hash():
    for img in _images():
        rgb = load_image(img)
        for kwargs in (None, {"size": {"shortest_edge": 20}}):
            assert hash_pil_pixels(rgb.mode, np.asarray(rgb), kwargs) == hash_mm_item("image", rgb, kwargs)
    a, b = _images()[:2]
    assert hash_pil_pixels("RGB", np.asarray(a)) != hash_pil_pixels("RGB", np.asarray(b))
