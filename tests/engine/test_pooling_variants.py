"""Poolers on a tiny Qwen2 text checkpoint against HF: MEAN / CLS / ALL (chunked too), the sentence-transformers
files, Matryoshka dimensions, a Qwen2ForSequenceClassification head (runner auto-detected), AsyncLLM."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch

from vlserve import LLM
from vlserve.pooling_params import PoolingParams

pytestmark = pytest.mark.hf_parity

TEXTS = ["the quick brown fox jumps over the lazy dog", "hello", "a somewhat longer sentence about pooling states"]


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    from vlserve.demo.checkpoints import build_text_checkpoint

    return build_text_checkpoint(str(tmp_path_factory.mktemp("qwen2_pool")), arch="qwen2")


@pytest.fixture(scope="module")
def hf_hidden(text_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(text_dir)
    model = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32).eval()

    def hidden(text: str) -> torch.Tensor:  # [T, H], the final (normed) hidden states
        with torch.no_grad():
            out = model(input_ids=torch.tensor([tok(text)["input_ids"]]), output_hidden_states=True)
        return out.hidden_states[-1][0].float()

    return hidden


def _llm(model_dir, **kw) -> LLM:
    return LLM(model_dir, dtype="float32", num_kv_blocks=64, **kw)


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS", "ALL"])
def test_poolers_match_hf(text_dir, hf_hidden, pooling_type):
    cfg = {"pooling_type": pooling_type}
    whole = _llm(text_dir, runner="pooling", convert="embed", pooler_config=cfg)
    chunked = _llm(text_dir, convert="embed", pooler_config=cfg, max_num_batched_tokens=4)
    try:
        assert not whole.engine.scheduler_config.enable_prefix_caching  # nothing to pool in a cached prefix
        for llm in (whole, chunked):
            outs = llm.encode(TEXTS, PoolingParams(task="encode"), use_tqdm=False)
            for out, text in zip(outs, TEXTS):
                states = hf_hidden(text)
                ref = {"MEAN": states.mean(dim=0), "CLS": states[0], "ALL": states}[pooling_type]
                assert out.outputs.data.shape == ref.shape
                assert torch.allclose(out.outputs.data, ref, atol=1e-4)
            llm.check_integrity()
        emb = whole.embed(TEXTS[0], use_tqdm=False)[0].outputs.embedding
        if pooling_type != "ALL":
            ref = torch.nn.functional.normalize(
                hf_hidden(TEXTS[0]).mean(dim=0) if pooling_type == "MEAN" else hf_hidden(TEXTS[0])[0], dim=-1
            )
            assert torch.nn.functional.cosine_similarity(torch.tensor(emb), ref, dim=0) >= 0.9999
    finally:
        whole.shutdown()
        chunked.shutdown()


def test_sentence_transformers_files_and_matryoshka(tmp_path, text_dir, hf_hidden):
    import shutil

    st_dir = str(tmp_path / "st")
    shutil.copytree(text_dir, st_dir)
    with open(os.path.join(st_dir, "modules.json"), "w") as f:
        json.dump(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ],
            f,
        )
    os.makedirs(os.path.join(st_dir, "1_Pooling"))
    with open(os.path.join(st_dir, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}, f)
    with open(os.path.join(st_dir, "config.json")) as f:
        config = json.load(f)
    config.update(is_matryoshka=True, matryoshka_dimensions=[16, 32, 64])
    with open(os.path.join(st_dir, "config.json"), "w") as f:
        json.dump(config, f)
    llm = _llm(st_dir, convert="embed")
    try:
        spec = llm.engine.pooler_spec
        assert (spec.pooling_type, spec.normalize) == ("MEAN", False)  # no Normalize module
        mean = hf_hidden(TEXTS[0]).mean(dim=0)
        emb = torch.tensor(llm.embed(TEXTS[0], use_tqdm=False)[0].outputs.embedding)
        assert torch.allclose(emb, mean, atol=1e-4)
        short = llm.embed(TEXTS[0], PoolingParams(dimensions=16, normalize=True), use_tqdm=False)[0]
        ref = torch.nn.functional.normalize(mean[:16], dim=-1)
        assert torch.allclose(torch.tensor(short.outputs.embedding), ref, atol=1e-5)
        with pytest.raises(ValueError, match="dimensions must be one of"):
            llm.embed(TEXTS[0], PoolingParams(dimensions=20), use_tqdm=False)
        llm.check_integrity()
    finally:
        llm.shutdown()
    overridden = _llm(st_dir, convert="embed", pooler_config={"pooling_type": "LAST", "normalize": True})
    try:
        assert (overridden.engine.pooler_spec.pooling_type, overridden.engine.pooler_spec.normalize) == ("LAST", True)
    finally:
        overridden.shutdown()


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, text_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = str(tmp_path_factory.mktemp("qwen2_cls"))
    torch.manual_seed(3)
    model = AutoModelForSequenceClassification.from_pretrained(text_dir, num_labels=3, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(text_dir).save_pretrained(out)
    return out


def test_sequence_classification_head_matches_hf(classifier_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(classifier_dir)
    hf = AutoModelForSequenceClassification.from_pretrained(classifier_dir, dtype=torch.float32).eval()
    llm = _llm(classifier_dir)  # runner auto: a *ForSequenceClassification checkpoint pools
    try:
        assert llm.engine.runner_type == "pooling"
        outs = llm.classify(TEXTS, use_tqdm=False)
        for out, text in zip(outs, TEXTS):
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([tok(text)["input_ids"]])).logits[0].float()
            assert torch.allclose(torch.tensor(out.outputs.probs), torch.softmax(logits, dim=-1), atol=1e-4)
        raw = llm.classify(TEXTS[0], PoolingParams(activation=False), use_tqdm=False)[0].outputs.probs
        assert len(raw) == 3
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_async_llm_add_pooling_request(text_dir, hf_hidden):
    from vlserve.config import EngineArgs
    from vlserve.engine.async_llm import AsyncLLM
    from vlserve.outputs import PoolingRequestOutput

    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=text_dir, dtype="float32", num_kv_blocks=64, runner="pooling", convert="embed")
    )

    async def run():
        assert engine.runner_type == "pooling" and engine.pooling_tasks == {"embed", "encode"}
        prompt = await engine.process_prompt(TEXTS[1])
        stream = await engine.add_pooling_request("p1", prompt, PoolingParams())
        outs = [o async for o in stream]
        with pytest.raises(ValueError, match="pools"):
            await engine.add_request("g1", prompt)
        with pytest.raises(ValueError, match="not served"):
            await engine.add_pooling_request("c1", prompt, PoolingParams(task="classify"))
        return outs

    try:
        outs = asyncio.run(run())
        assert len(outs) == 1 and isinstance(outs[0], PoolingRequestOutput) and outs[0].finished
        ref = torch.nn.functional.normalize(hf_hidden(TEXTS[1])[-1], dim=-1)
        assert torch.nn.functional.cosine_similarity(outs[0].outputs.data, ref, dim=0) >= 0.9999
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_engine_process_pools(text_dir, hf_hidden):
    from vlserve.config import EngineArgs
    from vlserve.engine.mp_async_llm import MPAsyncLLM

    engine = MPAsyncLLM.from_engine_args(
        EngineArgs(model=text_dir, dtype="float32", num_kv_blocks=64, convert="embed"), startup_timeout=120
    )

    async def run():
        assert engine.runner_type == "pooling" and engine.pooling_tasks == {"embed", "encode"}
        prompts = [await engine.process_prompt(t) for t in TEXTS]
        streams = [await engine.add_pooling_request(f"p{i}", p, PoolingParams()) for i, p in enumerate(prompts)]
        outs = [[o async for o in s][-1] for s in streams]
        with pytest.raises(ValueError, match="pools"):
            await engine.add_request("g1", prompts[0])
        return outs

    try:
        outs = asyncio.run(run())
        for out, text in zip(outs, TEXTS):
            ref = torch.nn.functional.normalize(hf_hidden(text)[-1], dim=-1)
            assert torch.nn.functional.cosine_similarity(out.outputs.data, ref, dim=0) >= 0.9999
    finally:
        engine.shutdown()


def test_a_prompt_of_max_model_len_pools(text_dir, hf_hidden):
    llm = _llm(text_dir, convert="embed", max_model_len=16)
    try:
        ids = (llm.tokenizer(TEXTS[2])["input_ids"] * 4)[:16]
        out = llm.encode({"prompt_token_ids": ids}, PoolingParams(task="encode"), use_tqdm=False)[0]
        assert out.outputs.data.shape == (64,)
        with pytest.raises(ValueError, match="max_model_len"):
            llm.encode({"prompt_token_ids": ids + ids[:1]}, use_tqdm=False)
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_per_prompt_pooling_params(text_dir):
    llm = _llm(text_dir, convert="embed")
    try:
        plain, raw = llm.embed(TEXTS[:2], [PoolingParams(), PoolingParams(normalize=False)], use_tqdm=False)
        assert abs(torch.tensor(plain.outputs.embedding).norm() - 1.0) < 1e-5
        assert abs(torch.tensor(raw.outputs.embedding).norm() - 1.0) > 1e-3
        with pytest.raises(ValueError, match="pooling params for 2 prompts"):
            llm.embed(TEXTS[:2], [PoolingParams()], use_tqdm=False)
        with pytest.raises(ValueError, match="must be PoolingParams"):
            llm.embed(TEXTS[0], {"normalize": False}, use_tqdm=False)
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_lora_adapter_embeddings_match_peft(tmp_path, text_dir, hf_hidden):
    from tests.lora.lora_helpers import make_adapter
    from vlserve.lora.request import LoRARequest

    adapter_dir, peft_model = make_adapter(text_dir, str(tmp_path / "adapter"))
    llm = _llm(text_dir, convert="embed", enable_lora=True)
    try:
        lora = LoRARequest("a", 1, adapter_dir)
        base, tuned = llm.embed([TEXTS[0], TEXTS[0]], lora_request=[None, lora], use_tqdm=False)
        ids = llm.tokenizer(TEXTS[0])["input_ids"]
        with torch.no_grad():
            ref = peft_model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        ref = torch.nn.functional.normalize(ref.float(), dim=-1)
        assert torch.nn.functional.cosine_similarity(torch.tensor(tuned.outputs.embedding), ref, dim=0) >= 0.9999
        base_ref = torch.nn.functional.normalize(hf_hidden(TEXTS[0])[-1], dim=-1)
        assert torch.nn.functional.cosine_similarity(torch.tensor(base.outputs.embedding), base_ref, dim=0) >= 0.9999
        llm.check_integrity()
    finally:
        llm.shutdown()
