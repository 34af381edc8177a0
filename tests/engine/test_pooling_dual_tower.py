"""CLIP and SigLIP dual towers served by the KV-free pooling runner (vlserve.worker.kv_free_runner): tiny random
checkpoints with their real processors (tests/support/dual_tower_checkpoints.py), `LLM.embed` / `score` against
HF's `get_text_features` / `get_image_features` (float32 and bf16), mixed text + image batches, chunked prefill,
the encoder cache running the image tower once per image, bad requests, AsyncLLM and the engine process."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from PIL import Image

from tests.support.dual_tower_checkpoints import TEXTS, build_checkpoint, features
from tests.support.hf_oracle import data_url
from vlserve import LLM
from vlserve.pooling_params import PoolingParams

pytestmark = pytest.mark.hf_parity


def _image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8))


IMAGES = [_image(40, 50, 0), _image(32, 32, 1), _image(64, 36, 2)]


def image_prompt(img) -> dict:
    return {"prompt": "", "multi_modal_data": {"image": img}}


@pytest.fixture(scope="module", params=["clip", "siglip"])
def tower(request, tmp_path_factory):
    """(family, checkpoint dir, HF text oracle, HF image oracle): each oracle gives HF's raw features `[D]`."""
    from transformers import AutoProcessor

    path = tmp_path_factory.mktemp(f"{request.param}_engine")
    hf_model, _ = build_checkpoint(request.param, path)
    processor = AutoProcessor.from_pretrained(path, use_fast=True)  # the fast image processor, as the engine loads it
    pad = {"padding": "max_length", "max_length": 16} if request.param == "siglip" else {}

    def hf_text(text: str) -> torch.Tensor:
        inputs = processor(text=[text], return_tensors="pt", **pad)
        if request.param == "siglip":  # SigLIP's own tokenizer returns no attention_mask: padding attends
            inputs.pop("attention_mask")
        with torch.no_grad():
            return features(hf_model.get_text_features(**inputs))[0]

    def hf_image(img) -> torch.Tensor:
        pixels = processor(images=[img], return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            return features(hf_model.get_image_features(pixel_values=pixels))[0]

    return request.param, str(path), hf_text, hf_image


def _llm(path: str, **kw) -> LLM:
    return LLM(path, dtype=kw.pop("dtype", "float32"), **kw)


def _assert_idle(llm: LLM) -> None:
    """Nothing held after a run: every block id free, no encoder entry referenced, the runner tracks no request."""
    llm.engine.step()  # the runner drops the finished requests
    llm.check_integrity()
    sched = llm.engine.scheduler
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks
    assert not sched.encoder_cache.req_to_hashes
    assert not llm.engine.runner.requests


def _cos(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a).float(), b.float(), dim=0).item()


def test_mixed_text_and_image_batch_matches_hf(tower):
    name, path, hf_text, hf_image = tower
    llm = _llm(path)  # runner "auto": a model with no decoder pools
    try:
        assert llm.engine.runner_type == "pooling" and llm.engine.pooling_tasks == {"embed", "encode"}
        assert llm.engine.model_capabilities.dual_tower and llm.engine.model_capabilities.kv_free
        assert not llm.engine.scheduler_config.enable_prefix_caching
        runner = llm.engine.runner
        assert runner.kv_caches == [] and runner.bytes_per_block() == 0  # no KV tensor at all
        prompts = [TEXTS[0], image_prompt(IMAGES[0]), TEXTS[1], image_prompt(IMAGES[1]), TEXTS[3]]
        refs = [hf_text(TEXTS[0]), hf_image(IMAGES[0]), hf_text(TEXTS[1]), hf_image(IMAGES[1]), hf_text(TEXTS[3])]
        calls = runner.num_pool_calls
        texts = llm.embed(TEXTS, use_tqdm=False)
        assert runner.num_pool_calls == calls + 1  # the texts ended in one step: one batched call
        for out, text in zip(texts, TEXTS):
            assert _cos(out.outputs.embedding, hf_text(text)) >= 0.9999
        steps = llm.engine.num_steps
        outs = llm.embed(prompts, use_tqdm=False)  # texts and images in one call
        assert runner.num_pool_calls == calls + 2  # all in one step (no decode streams to keep the encoder short for)
        assert llm.engine.num_steps == steps + 1
        raw = llm.embed(prompts, PoolingParams(normalize=False), use_tqdm=False)
        for out, raw_out, ref in zip(outs, raw, refs):
            emb = torch.tensor(out.outputs.embedding)
            assert emb.shape == ref.shape and abs(emb.norm().item() - 1) < 1e-5  # normalized by default
            assert _cos(emb, ref) >= 0.9999
            assert torch.allclose(torch.tensor(raw_out.outputs.embedding), ref, atol=1e-4)
        assert len(outs[1].prompt_token_ids) == 1  # an image: one placeholder token
        if name == "siglip":
            assert all(len(outs[i].prompt_token_ids) == 16 for i in (0, 2, 4))  # padded to max_length
        _assert_idle(llm)
    finally:
        llm.shutdown()


def test_bf16_is_close_to_hf(tower):
    _, path, hf_text, hf_image = tower
    llm = _llm(path, dtype="bfloat16")
    try:
        outs = llm.embed([TEXTS[1], image_prompt(IMAGES[2])], use_tqdm=False)
        assert _cos(outs[0].outputs.embedding, hf_text(TEXTS[1])) >= 0.99
        assert _cos(outs[1].outputs.embedding, hf_image(IMAGES[2])) >= 0.99
        _assert_idle(llm)
    finally:
        llm.shutdown()


def test_chunked_prefill_pools_once_from_the_whole_prompt(tower):
    _, path, hf_text, _ = tower
    whole, chunked = _llm(path), _llm(path, max_num_batched_tokens=4, max_num_seqs=2)
    try:
        prompts = TEXTS + [image_prompt(IMAGES[0])]
        a = whole.embed(prompts, use_tqdm=False)
        b = chunked.embed(prompts, use_tqdm=False)
        for x, y in zip(a, b):
            assert torch.allclose(torch.tensor(x.outputs.embedding), torch.tensor(y.outputs.embedding), atol=1e-5)
        long_text = TEXTS[3]
        assert len(b[3].prompt_token_ids) > 4  # it ran over several steps
        assert _cos(b[3].outputs.embedding, hf_text(long_text)) >= 0.9999
        _assert_idle(chunked)
    finally:
        whole.shutdown()
        chunked.shutdown()


def test_the_encoder_cache_runs_the_tower_once_per_image(tower):
    _, path, _, hf_image = tower
    llm = _llm(path)
    try:
        first = llm.embed([image_prompt(IMAGES[0]), image_prompt(IMAGES[1]), image_prompt(IMAGES[0])], use_tqdm=False)
        again = llm.embed(image_prompt(IMAGES[0]), use_tqdm=False)[0]
        metrics = llm.get_metrics()
        assert metrics["vlserve:encoder_runs_total"] == 2  # two distinct images, four requests
        assert metrics['vlserve:encoder_runs_by_modality_total{modality="image"}'] == 2
        assert metrics["vlserve:encoder_cache_hits_total"] >= 2
        assert first[0].outputs.embedding == first[2].outputs.embedding == again.outputs.embedding
        assert _cos(again.outputs.embedding, hf_image(IMAGES[0])) >= 0.9999
        _assert_idle(llm)
    finally:
        llm.shutdown()


def test_conversations_and_score(tower):
    name, path, hf_text, hf_image = tower
    llm = _llm(path)
    try:
        image_chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMAGES[1])}}]}]
        text_chat = [{"role": "user", "content": [{"type": "text", "text": TEXTS[2]}]}]
        outs = llm.embed([image_chat, text_chat, [{"role": "user", "content": TEXTS[2]}]], use_tqdm=False)
        assert _cos(outs[0].outputs.embedding, hf_image(IMAGES[1])) >= 0.9999
        assert _cos(outs[1].outputs.embedding, hf_text(TEXTS[2])) >= 0.9999
        assert outs[1].outputs.embedding == outs[2].outputs.embedding
        docs = [{"content": [{"type": "image_url", "image_url": {"url": data_url(img)}}]} for img in IMAGES[::2]]
        scores = llm.score(TEXTS[0], docs, use_tqdm=False)  # vLLM's multimodal score inputs
        ref_text = hf_text(TEXTS[0])
        for score, img in zip(scores, (IMAGES[0], IMAGES[2])):
            ref = torch.nn.functional.cosine_similarity(ref_text, hf_image(img), dim=0).item()
            assert abs(score.outputs.score - ref) < 1e-4
        _assert_idle(llm)
    finally:
        llm.shutdown()


def test_bad_requests_are_refused(tower):
    name, path, _, _ = tower
    with pytest.raises(ValueError, match="dual-tower embedder.*runner='pooling'"):
        LLM(path, runner="generate")
    with pytest.raises(ValueError, match="dual-tower embedder"):
        LLM(path, convert="classify")
    with pytest.raises(ValueError, match="pooling_type"):
        LLM(path, pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(ValueError, match="no LM head"):
        LLM(path, convert="classify", pooler_config={"classifier_from_token": ["a"]})
    with pytest.raises(ValueError, match="without LoRA"):
        LLM(path, enable_lora=True)
    no_images = _llm(path, limit_mm_per_prompt={"image": 0})
    try:
        with pytest.raises(ValueError, match="limit_mm_per_prompt"):
            no_images.embed(image_prompt(IMAGES[0]), use_tqdm=False)
    finally:
        no_images.shutdown()
    llm = _llm(path, runner="pooling")
    try:
        both = {"prompt": TEXTS[0], "multi_modal_data": {"image": IMAGES[0]}}
        two = {"prompt": "", "multi_modal_data": {"image": IMAGES[:2]}}
        video = {"prompt": "", "multi_modal_data": {"video": [np.zeros((2, 32, 32, 3), dtype=np.uint8)]}}
        mixed_chat = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a cat"},
                    {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}},
                ],
            }
        ]
        for bad, match in [
            (both, "not both"),
            (two, "one image per request"),
            (video, "video input was given to a model that takes image"),
            (mixed_chat, "one text or one image"),
            ({"prompt_token_ids": [10_000]}, "prompt_token_ids must be"),
            ({"prompt": 5}, "must be a string"),
            ({"multi_modal_data": {}}, "needs 'prompt'"),
        ]:
            with pytest.raises(ValueError, match=match):
                llm.embed(bad, use_tqdm=False)
        if name == "clip":  # CLIP pools at the EOS token: ids without it are refused before they reach the engine
            with pytest.raises(ValueError, match="EOS"):
                llm.embed({"prompt_token_ids": [0, 3, 4]}, use_tqdm=False)
        # a prompt made without the front end's rules (the API's add_special_tokens=false) is checked at the engine
        from vlserve.engine.engine_loop import NewRequest
        from vlserve.engine.input_processor import ProcessedPrompt

        image = llm.input_processor.process_prompt(image_prompt(IMAGES[0]))
        for ids, feats in [([0, 3, 4] if name == "clip" else [10_000], []), ([0, 0], image.mm_features)]:
            bad = NewRequest("raw", ProcessedPrompt(None, ids, feats), PoolingParams(), 0.0)
            with pytest.raises(ValueError, match="EOS|prompt_token_ids|placeholder"):
                llm.engine_loop.add_pooling_requests([bad])
        with pytest.raises(ValueError, match="runner='pooling'"):
            llm.generate(TEXTS[0], use_tqdm=False)
        with pytest.raises(ValueError, match="not served"):
            llm.classify(TEXTS[0], use_tqdm=False)
        assert llm.embed(TEXTS[0], use_tqdm=False)[0].outputs.embedding  # still serving
        _assert_idle(llm)
    finally:
        llm.shutdown()


def test_async_llm_embeds_a_chat_image(tower):
    from vlserve.config import EngineArgs
    from vlserve.engine.async_llm import AsyncLLM

    _, path, _, hf_image = tower
    engine = AsyncLLM.from_engine_args(EngineArgs(model=path, dtype="float32"))

    async def run():
        assert engine.runner_type == "pooling" and engine.model_capabilities.dual_tower
        chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(IMAGES[2])}}]}]
        prompt = await engine.process_chat(chat)
        stream = await engine.add_pooling_request("img", prompt, PoolingParams())
        return [o async for o in stream]

    try:
        outs = asyncio.run(run())
        assert len(outs) == 1 and outs[0].finished
        assert _cos(outs[0].outputs.data, hf_image(IMAGES[2])) >= 0.9999
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_engine_process_embeds_text_and_images(tower):
    from vlserve.config import EngineArgs
    from vlserve.engine.mp_async_llm import MPAsyncLLM

    _, path, hf_text, hf_image = tower
    engine = MPAsyncLLM.from_engine_args(EngineArgs(model=path, dtype="float32"), startup_timeout=120)

    async def run():
        assert engine.runner_type == "pooling" and engine.model_capabilities.dual_tower
        prompts = [await engine.process_prompt(TEXTS[1]), await engine.process_prompt(image_prompt(IMAGES[0]))]
        streams = [await engine.add_pooling_request(f"p{i}", p, PoolingParams()) for i, p in enumerate(prompts)]
        return [[o async for o in s][-1] for s in streams]

    try:
        text_out, image_out = asyncio.run(run())
        assert _cos(text_out.outputs.data, hf_text(TEXTS[1])) >= 0.9999
        assert _cos(image_out.outputs.data, hf_image(IMAGES[0])) >= 0.9999
    finally:
        engine.shutdown()
