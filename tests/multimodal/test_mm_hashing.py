"""hash_mm_item: same content + kwargs => same hash; any difference => different hash."""

from __future__ import annotations

import numpy as np
from mm_media import rand_image
from PIL import Image

from vlserve.multimodal.hashing import hash_mm_item
from vlserve.multimodal.media import load_video


def test_same_content_same_hash():
    a = rand_image(8, 9)
    assert hash_mm_item("image", a, {"max_pixels": 10}) == hash_mm_item("image", a.copy(), {"max_pixels": 10})
    # PIL image of the same pixels, kwargs in another order.
    kw1, kw2 = {"min_pixels": 1, "max_pixels": 10}, {"max_pixels": 10, "min_pixels": 1}
    assert hash_mm_item("image", Image.fromarray(a), kw1) == hash_mm_item("image", Image.fromarray(a.copy()), kw2)
    # A non-contiguous view hashes like its contiguous copy.
    big = rand_image(8, 18)
    assert hash_mm_item("image", big[:, ::2]) == hash_mm_item("image", np.ascontiguousarray(big[:, ::2]))
    assert len(hash_mm_item("image", a)) == 64


def test_differences_change_hash():
    a = rand_image(8, 9)
    base = hash_mm_item("image", a, {"max_pixels": 10})
    b = a.copy()
    b[3, 4, 1] ^= 1  # one bit of one pixel
    assert hash_mm_item("image", b, {"max_pixels": 10}) != base
    assert hash_mm_item("image", a, {"max_pixels": 11}) != base
    assert hash_mm_item("image", a, None) != base
    assert hash_mm_item("video", a, {"max_pixels": 10}) != base
    assert hash_mm_item("image", a.reshape(9, 8, 3), {"max_pixels": 10}) != base  # same bytes, other shape
    assert hash_mm_item("image", a.astype(np.int16), {"max_pixels": 10}) != base  # other dtype
    assert hash_mm_item("image", a.tobytes()) != hash_mm_item("image", a)


def test_video_hash_includes_sampled_fps():
    clip = np.stack([rand_image(4, 4, seed=s) for s in range(4)])
    v1, v2 = load_video(clip, fps=1.0), load_video(clip, fps=2.0)
    assert hash_mm_item("video", v1) == hash_mm_item("video", load_video(clip.copy(), fps=1.0))
    assert hash_mm_item("video", v1) != hash_mm_item("video", v2)
    assert hash_mm_item("video", [f for f in clip]) == hash_mm_item("video", [f.copy() for f in clip])
