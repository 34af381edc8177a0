"""The torchvision-backed ("fast") HF image processors are the default where transformers has one, `use_fast: false`
brings the slow (PIL / numpy) one back, and the two agree: the same grids, tiles and placeholder counts, and pixel
values within the tolerances below, for several sizes and aspect ratios per family. Processors come from the demo
model's config and from locally written tiny checkpoints (no hub).

Tolerance, in uint8 levels (one level = 1 / 255 / image_std after normalization): the two resize differently
rounded, and their antialiasing kernels differ on high-frequency content. On smooth images every value is within
SMOOTH_MAX_LEVELS; on uniform noise (the worst case: 37x211 squeezed to 28 rows while widened, up to ~13 levels on
a few values) the mean difference is at most NOISE_MEAN_LEVELS and at most NOISE_FAR_FRACTION of the values differ
by more than SMOOTH_MAX_LEVELS.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mm_media import rand_image
from PIL import Image

from vlserve.multimodal.processor import MultiModalProcessor, is_fast_image_processor

pytestmark = pytest.mark.hf_parity

SMOOTH_MAX_LEVELS = 2.5
NOISE_MEAN_LEVELS = 0.5
NOISE_FAR_FRACTION = 0.03
SIZES = [(100, 100), (37, 211), (300, 120), (3, 50), (1, 40), (512, 384), (64, 900)]  # (h, w): square, wide, tall


def smooth_image(h: int, w: int, seed: int = 0) -> np.ndarray:
    """An HxWx3 uint8 image of slow sinusoids (photo-like: little energy at the pixel scale)."""
    y, x = np.mgrid[0:h, 0:w]
    period = 7 + np.random.RandomState(seed).rand() * 5
    return np.stack([127 + 120 * np.sin(x / period + y / (9 + c)) for c in range(3)], -1).astype(np.uint8)


@pytest.fixture(scope="module")
def local_dirs(tmp_path_factory):
    """Tiny checkpoints written here: a Qwen2-VL with a pixel range (grids vary with the image), LLaVA-1.5 with CLIP
    and SigLIP, LLaVA-NeXT (anyres tiles) with CLIP and SigLIP."""
    from vlserve.demo.llava_checkpoints import build_llava_checkpoint
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    root = tmp_path_factory.mktemp("fast_procs")
    dirs = {"qwen2_vl": build_qwen2_vl_checkpoint(str(root / "qwen2_vl"), variant="qwen2_vl")}
    for variant in ("llava", "llava_next"):
        for tower in ("clip", "siglip"):
            dirs[f"{variant}_{tower}"] = build_llava_checkpoint(
                str(root / f"{variant}_{tower}"), variant=variant, tower=tower
            )
    return dirs


@pytest.fixture(
    scope="module", params=["demo", "qwen2_vl", "llava_clip", "llava_siglip", "llava_next_clip", "llava_next_siglip"]
)
def pair(request, local_dirs):
    """(fast, slow) MultiModalProcessors of one checkpoint."""
    from vlserve.demo import default_model_path

    path = default_model_path() if request.param == "demo" else local_dirs[request.param]
    return MultiModalProcessor.from_pretrained(path), MultiModalProcessor.from_pretrained(path, use_fast=False)


def test_fast_is_the_default_and_use_fast_false_is_slow(pair):
    fast, slow = pair
    assert is_fast_image_processor(fast.image_processor), type(fast.image_processor).__name__
    assert not is_fast_image_processor(slow.image_processor), type(slow.image_processor).__name__
    assert type(fast.hf_processor) is type(slow.hf_processor)
    assert fast.max_image_embeds() == slow.max_image_embeds()


@pytest.mark.parametrize("kind", ["smooth", "noise"])
def test_fast_matches_slow_over_sizes_and_aspect_ratios(pair, kind):
    fast, slow = pair
    level = 1 / 255 / float(min(slow.image_processor.image_std))
    for i, (h, w) in enumerate(SIZES):
        img = Image.fromarray((smooth_image if kind == "smooth" else rand_image)(h, w, seed=i))
        hash_f, a = fast.process_image(img)
        hash_s, b = slow.process_image(img)
        assert hash_f == hash_s  # same pixels, same kwargs
        assert set(a) == set(b)
        for key in a:
            if not a[key].is_floating_point():
                assert torch.equal(a[key], b[key]), (h, w, key)  # grids, image sizes
                continue
            assert a[key].shape == b[key].shape, (h, w, key)
            levels = (a[key].float() - b[key].float()).abs() / level
            if kind == "smooth":
                assert float(levels.max()) <= SMOOTH_MAX_LEVELS, (h, w, key, float(levels.max()))
            else:
                assert float(levels.mean()) <= NOISE_MEAN_LEVELS, (h, w, key, float(levels.mean()))
                far = float((levels > SMOOTH_MAX_LEVELS).float().mean())
                assert far <= NOISE_FAR_FRACTION, (h, w, key, far)


def test_token_counts_equal(pair):
    """The expanded prompt (one placeholder run per image, its length the item's embedding count) is the same."""
    fast, slow = pair
    tok = fast.tokenizer
    placeholder = fast.image_token_id
    prompt = tok("describe: ").input_ids + [placeholder] + tok(" and ").input_ids + [placeholder] + [placeholder]
    images = [Image.fromarray(rand_image(h, w, seed=10 + i)) for i, (h, w) in enumerate(SIZES[:3])]
    ids_f, feats_f = fast.process(prompt, images=images)
    ids_s, feats_s = slow.process(prompt, images=images)
    assert ids_f == ids_s
    assert [(f.offset, f.length) for f in feats_f] == [(f.offset, f.length) for f in feats_s]
    assert len(ids_f) > len(prompt)


def test_perception_lm_keeps_its_only_image_processor(tmp_path):
    """PerceptionLM has a torchvision processor only: `use_fast: false` keeps it (and its outputs)."""
    from tests.support.plm_checkpoints import build_plm_checkpoint

    path = build_plm_checkpoint(str(tmp_path / "plm"))
    fast, slow = MultiModalProcessor.from_pretrained(path), MultiModalProcessor.from_pretrained(path, use_fast=False)
    assert type(fast.image_processor) is type(slow.image_processor)
    img = Image.fromarray(rand_image(90, 150, seed=3))
    assert torch.equal(fast.process_image(img)[1]["pixel_values"], slow.process_image(img)[1]["pixel_values"])


def test_use_fast_is_a_load_time_key(pair):
    """`use_fast` in mm_processor_kwargs (the server's --mm-processor-kwargs reach every item) never reaches the HF
    call or the item hash; EngineArgs refuses a non-bool."""
    from vlserve.config import EngineArgs

    fast, _ = pair
    prompt = [fast.image_token_id]
    img = np.asarray(rand_image(40, 60, seed=4))
    plain = fast.process(prompt, images=[img])[1][0]
    flagged = fast.process(prompt, images=[img], mm_processor_kwargs={"use_fast": False})[1][0]
    assert plain.mm_hash == flagged.mm_hash
    with pytest.raises(ValueError, match="use_fast must be true or false"):
        EngineArgs(mm_processor_kwargs={"use_fast": "no"})
    with pytest.raises(ValueError, match="mm_preprocess_workers"):
        EngineArgs(mm_preprocess_workers=0)
