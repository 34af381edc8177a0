"""Disaggregated prefill / decode of Qwen2-VL image requests (P2PConnector, two engines in this process): the
producer encodes the image; its kv_transfer_params carry the expanded prompt and the items without pixel data
(span, mm_hash, grid for M-RoPE); the consumer gets only those (no media), never runs the vision tower, and gives
one engine's greedy tokens, token for token."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from vlserve import LLM, SamplingParams
from vlserve.config import KVTransferConfig

TEXT = "Describe the picture in great detail, mentioning colours and shapes."
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 56, 3), dtype=np.uint8))


def _llm(model_dir, role=None):
    cfg = None if role is None else KVTransferConfig("P2PConnector", role, {})
    return LLM(
        model_dir, dtype="float32", num_kv_blocks=48, block_size=4, max_model_len=128, seed=0, kv_transfer_config=cfg
    )


@pytest.mark.slow
def test_image_prefill_on_a_decode_on_b_without_media(qwen2_vl_dir, mooncake):
    images = [_image(1), _image(2)]
    ref = _llm(qwen2_vl_dir)
    want = [
        list(
            ref.generate(TEXT, SamplingParams(max_tokens=6, **GREEDY), images=[im], use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )
        for im in images
    ]
    del ref
    assert want[0] != want[1]  # the image matters
    a, b = _llm(qwen2_vl_dir, "kv_producer"), _llm(qwen2_vl_dir, "kv_consumer")
    for im, w in zip(images, want):
        pre = a.generate(
            TEXT,
            SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}, **GREEDY),
            images=[im],
            use_tqdm=False,
        )[0]
        params = pre.kv_transfer_params
        assert list(pre.outputs[0].token_ids) == w[:1]
        assert params["remote_prompt_token_ids"] == list(pre.prompt_token_ids)
        (item,) = params["remote_mm_features"]
        assert set(item["data"]) == {"image_grid_thw"} and item["length"] > 0
        json.dumps(params)  # what the proxy forwards: plain JSON, no pixel data
        # the consumer's request: a placeholder prompt and the params, no media
        out = b.generate(
            {"prompt_token_ids": [0]}, SamplingParams(max_tokens=6, kv_transfer_params=params, **GREEDY), use_tqdm=False
        )[0]
        assert list(out.outputs[0].token_ids) == w
        assert list(out.prompt_token_ids) == params["remote_prompt_token_ids"]
    mb, ma = b.get_metrics(), a.get_metrics()
    assert mb["vlserve:encoder_runs_total"] == 0 and mb["vlserve:kv_p2p_failed_loads_total"] == 0
    assert mb["vlserve:kv_p2p_loaded_blocks_total"] > 0
    assert ma["vlserve:encoder_runs_total"] == 2
    a.check_integrity()
    b.check_integrity()


@pytest.mark.slow
def test_media_less_request_whose_read_fails_ends_with_an_error(qwen2_vl_dir, mooncake):
    """An unreachable producer: the consumer cannot recompute the image (it has none), so the request ends "abort"
    with an error instead of running the tower on nothing; the engine stays sound."""
    a = _llm(qwen2_vl_dir, "kv_producer")
    params = a.generate(
        TEXT,
        SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}, **GREEDY),
        images=[_image(3)],
        use_tqdm=False,
    )[0].kv_transfer_params
    a.shutdown()
    b = _llm(qwen2_vl_dir, "kv_consumer")
    bogus = {**params, "remote_port": 9}
    out = b.generate(
        {"prompt_token_ids": [0]}, SamplingParams(max_tokens=4, kv_transfer_params=bogus, **GREEDY), use_tqdm=False
    )[0]
    assert out.outputs[0].finish_reason == "abort" and not out.outputs[0].token_ids
    assert b.get_metrics()["vlserve:encoder_runs_total"] == 0
    b.check_integrity()


@pytest.mark.slow
def test_bad_remote_items_are_refused_before_the_engine(qwen2_vl_dir, mooncake):
    """Params whose items do not fit the prompt or their grid: ValueError when the request is added, the engine
    untouched."""
    a = _llm(qwen2_vl_dir, "kv_producer")
    params = a.generate(
        TEXT,
        SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}, **GREEDY),
        images=[_image(4)],
        use_tqdm=False,
    )[0].kv_transfer_params
    a.shutdown()
    b = _llm(qwen2_vl_dir, "kv_consumer")
    (item,) = params["remote_mm_features"]
    bad = [
        {**params, "remote_mm_features": [{**item, "length": item["length"] - 1}]},  # grid says otherwise
        {**params, "remote_mm_features": [{**item, "data": {}}]},  # no grid for M-RoPE
        {**params, "remote_mm_features": [{**item, "offset": 10_000}]},  # past the prompt
        {**params, "remote_prompt_token_ids": ["x"]},
    ]
    for p in bad:
        with pytest.raises(ValueError, match="remote_"):
            b.generate(
                {"prompt_token_ids": [0]}, SamplingParams(max_tokens=2, kv_transfer_params=p, **GREEDY), use_tqdm=False
            )
    b.check_integrity()
    assert not b.engine.scheduler.requests
