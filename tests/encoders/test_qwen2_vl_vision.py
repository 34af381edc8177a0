"""Our Qwen2-VL / Qwen2.5-VL vision towers against transformers' towers (the oracle, on the same random weights),
one batched call against per-item calls, and the runner's one-call-per-modality batching."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlserve.encoders import Qwen2_5VisionTower, Qwen2VisionTower, qwen2_5_vl_tower_config, qwen2_vl_tower_config
from vlserve.encoders.qwen2_5_vl_vision import window_order
from vlserve.encoders.staged import StagedTower

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

# three images of different sizes (one with partial edge windows) and a 3-frame-patch video, in one call
GRIDS = [(1, 4, 6), (1, 12, 14), (3, 8, 10), (1, 2, 2)]
ROW = 3 * 2 * 14 * 14


def _pixels(grids, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), ROW, generator=g)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def checkpoint(request, tmp_path_factory):
    """(variant, tiny checkpoint dir); Qwen2.5-VL gets windowed blocks 0 and 2 and a full-attention block 1."""
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    d = build_qwen2_vl_checkpoint(
        str(tmp_path_factory.mktemp(request.param)),
        variant=request.param,
        vision_depth=3,
        fullatt_block_indexes=(1,),
        seed=3,
    )
    return request.param, d


@pytest.fixture(scope="module")
def towers(checkpoint):
    """(ours, transformers' tower) sharing the checkpoint's random weights."""
    from transformers import AutoModelForImageTextToText

    variant, d = checkpoint
    ref = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    hf_tower = ref.model.visual
    vision_config = ref.config.vision_config
    if variant == "qwen2_vl":
        ours = Qwen2VisionTower(qwen2_vl_tower_config(vision_config))
    else:
        ours = Qwen2_5VisionTower(qwen2_5_vl_tower_config(vision_config))
    ours.load_state_dict(hf_tower.state_dict(), strict=True)  # same names and shapes as the checkpoint
    return ours.eval(), hf_tower


@torch.no_grad()
def test_tower_matches_hf_on_mixed_batch(towers):
    ours, hf_tower = towers
    pixels = _pixels(GRIDS)
    expected = hf_tower(pixels, grid_thw=torch.tensor(GRIDS))
    expected = getattr(expected, "pooler_output", expected)  # transformers 5.x returns an output object
    out = ours(pixels, GRIDS)
    assert out.shape == (sum(ours.num_embeddings(GRIDS)), hf_tower.merger.mlp[2].out_features)
    # HF patch-embeds with Conv3d, we with one GEMM: oneDNN sums those in another order (AVX2 machines: up to 1.1e-5)
    torch.testing.assert_close(out, expected, atol=3e-5, rtol=1e-5)


@torch.no_grad()
def test_one_call_equals_separate_calls(towers):
    ours, _ = towers
    pixels = _pixels(GRIDS, seed=1)
    together = ours(pixels, torch.tensor(GRIDS))
    rows = [t * h * w for t, h, w in GRIDS]
    separate = [ours(p, [g]) for p, g in zip(pixels.split(rows), GRIDS)]
    torch.testing.assert_close(together, torch.cat(separate), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_staged_slices_equal_one_forward(towers):
    """begin -> blocks a slice at a time (every cut: windowed and full-attention blocks on both sides) -> finish
    gives forward's embeddings exactly."""
    ours, _ = towers
    assert isinstance(ours, StagedTower) and ours.num_stages == 3
    pixels = _pixels(GRIDS, seed=2)
    whole = ours(pixels, GRIDS)
    for cuts in ([0, 1, 2, 3], [0, 2, 3], [0, 1, 3]):
        state = ours.begin_stages(pixels, GRIDS)
        for start, end in zip(cuts, cuts[1:]):
            state = ours.run_stages(state, start, end)
        assert torch.equal(ours.finish_stages(state), whole)


def test_bad_grids_are_value_errors(towers):
    ours, _ = towers
    with pytest.raises(ValueError, match="grids cover 24 patches but 20"):
        ours(torch.zeros(20, ROW), [(1, 4, 6)])
    with pytest.raises(ValueError, match="multiples of 2"):
        ours(torch.zeros(15, ROW), [(1, 3, 5)])
    with pytest.raises(ValueError, match=r"pixel rows must be \[P, 1176\]"):
        ours(torch.zeros(24, 7), [(1, 4, 6)])


def test_window_order_tiles_frames_row_major():
    # one 2-frame item of 3x5 merge units, windows of 2x2: per frame 2 x 3 windows, the edges smaller
    order, sizes = window_order([(2, 3, 5)], 2)
    assert sizes == [4, 4, 2, 2, 2, 1] * 2
    assert order[:6].tolist() == [0, 1, 5, 6, 2, 3]
    assert sorted(order.tolist()) == list(range(30))
    assert order[15:19].tolist() == [15, 16, 20, 21]  # the second frame starts after the first, same tiling


def _rand_media(shape, seed):
    return np.random.RandomState(seed).randint(0, 256, shape, dtype=np.uint8)


def test_runner_encodes_each_modality_once_per_step(checkpoint):
    """Three images and a video over two requests (one image in both) -> one image call and one video call; each
    cached output equals encoding that item alone."""
    from transformers import AutoConfig, AutoProcessor

    import vlserve.models.qwen2_vl  # noqa: F401  (registers the architectures)
    from vlserve.core.sched_output import CachedRequestData, SchedulerOutput
    from vlserve.models import load_model
    from vlserve.multimodal.processor import MultiModalProcessor
    from vlserve.sampling_params import SamplingParams
    from vlserve.worker.model_runner import ModelRunner
    from vlserve.worker.request_state import CachedRequestState

    _, d = checkpoint
    cfg = AutoConfig.from_pretrained(d)
    model = load_model(d, cfg, torch.float32, "cpu")
    hf_proc = AutoProcessor.from_pretrained(d)
    proc = MultiModalProcessor(hf_proc)
    image, video = "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"
    shared = _rand_media((60, 90, 3), 1)
    prompts = {
        "a": proc.process(
            hf_proc.tokenizer(image + video).input_ids, images=[shared], videos=[_rand_media((4, 56, 84, 3), 2)]
        ),
        "b": proc.process(hf_proc.tokenizer(image + image).input_ids, images=[shared, _rand_media((84, 56, 3), 3)]),
    }
    runner = ModelRunner(model, cfg, torch.device("cpu"), torch.float32, block_size=16)
    for rid, (ids, feats) in prompts.items():
        runner.requests[rid] = CachedRequestState(
            req_id=rid,
            token_ids=list(ids),
            num_prompt_tokens=len(ids),
            sampling_params=SamplingParams(),
            generator=None,
            block_ids=[],
            num_computed_tokens=0,
            mm_features=feats,
        )
    calls = []
    encode = model.embed_multimodal
    model.embed_multimodal = lambda modality, data: calls.append(modality) or encode(modality, data)
    runner.encoders.run(
        SchedulerOutput([], CachedRequestData(), {}, 0, scheduled_encoder_inputs={"a": [0, 1], "b": [0, 1]}),
        runner.requests,
    )
    assert sorted(calls) == ["image", "video"]
    held = {f.mm_hash for _, feats in prompts.values() for f in feats if runner.encoders.lookup(f.mm_hash) is not None}
    assert runner.encoders.counters().num_runs == 3 and len(held) == 3  # the shared image once
    for _, feats in prompts.values():
        for feat in feats:
            torch.testing.assert_close(
                runner.encoders.lookup(feat.mm_hash), encode(feat.modality, feat.data), atol=1e-5, rtol=1e-5
            )


def test_config_reading_handles_both_width_namings():
    from types import SimpleNamespace

    common = dict(depth=2, num_heads=4, patch_size=14, temporal_patch_size=2, spatial_merge_size=2)
    # Qwen2-VL: the tower width is embed_dim, hidden_size is what the merger projects to
    old = qwen2_vl_tower_config(SimpleNamespace(embed_dim=32, hidden_size=64, mlp_ratio=2, **common))
    assert (old.width, old.out_dim, old.mlp_hidden, old.hidden_act) == (32, 64, 64, "quick_gelu")
    # a config that names them like Qwen2.5-VL (hidden_size = width, out_hidden_size = merger output)
    new = qwen2_vl_tower_config(SimpleNamespace(hidden_size=32, out_hidden_size=64, **common))
    assert (new.width, new.out_dim) == (32, 64)
    v25 = qwen2_5_vl_tower_config(
        SimpleNamespace(
            hidden_size=32,
            out_hidden_size=64,
            intermediate_size=48,
            window_size=112,
            fullatt_block_indexes=[1],
            **common,
        )
    )
    assert (v25.width, v25.out_dim, v25.mlp_hidden, v25.fullatt_block_indexes) == (32, 64, 48, (1,))
    with pytest.raises(ValueError, match="hidden_act 'relu6'"):
        Qwen2VisionTower(
            qwen2_vl_tower_config(SimpleNamespace(embed_dim=32, hidden_size=64, hidden_act="relu6", **common))
        )
