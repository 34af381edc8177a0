"""Speculative decoding through the engine: greedy output identical with n-gram drafts on and off."""

import pytest
import torch
from PIL import Image

from tests.multimodal.mm_media import rand_image
from vlserve import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    from vlserve.demo.checkpoints import build_text_checkpoint

    return build_text_checkpoint(str(tmp_path_factory.mktemp("spec_qwen2")), arch="qwen2")


def copy_heavy_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 600, (5 + i % 4,), generator=g).tolist() * (4 + i % 3) for i in range(n)]


def _greedy(n=24):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefill
        {"num_kv_blocks": 12, "max_num_batched_tokens": 64},  # forced preemption
    ],
    ids=["plain", "chunked", "preempt"],
)
def test_ngram_greedy_equals_plain(text_model, engine_kwargs):
    prompts = copy_heavy_prompts(6)
    kw = {"dtype": "float32", "num_kv_blocks": 128, **engine_kwargs}
    base = LLM(text_model, **kw).generate(prompts, _greedy(), use_tqdm=False)
    spec_llm = LLM(text_model, speculative_config=NGRAM, **kw)
    spec = spec_llm.generate(prompts, _greedy(), use_tqdm=False)
    for i, (b, s) in enumerate(zip(base, spec)):
        assert s.outputs[0].token_ids == b.outputs[0].token_ids, f"prompt {i}"
    m = spec_llm.get_metrics()
    assert m["vlserve:spec_decode_num_drafts_total"] > 0
    assert 0 < m["vlserve:spec_decode_num_accepted_tokens_total"] <= m["vlserve:spec_decode_num_draft_tokens_total"]
    assert m["vlserve:generation_tokens_total"] == 24 * len(prompts)
    if "num_kv_blocks" in engine_kwargs and engine_kwargs["num_kv_blocks"] < 20:
        assert m["vlserve:num_preemptions_total"] > 0
    spec_llm.check_integrity()


def test_ngram_respects_max_tokens_and_stop_ids(text_model):
    prompts = copy_heavy_prompts(4, seed=1)
    base = LLM(text_model, dtype="float32", num_kv_blocks=128)
    spec = LLM(text_model, dtype="float32", num_kv_blocks=128, speculative_config=NGRAM)
    for sp in (_greedy(7), SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[prompts[0][2]])):
        a = [o.outputs[0] for o in base.generate(prompts, sp, use_tqdm=False)]
        b = [o.outputs[0] for o in spec.generate(prompts, sp, use_tqdm=False)]
        assert [x.token_ids for x in a] == [x.token_ids for x in b]
        assert [x.finish_reason for x in a] == [x.finish_reason for x in b]
    spec.check_integrity()


def test_ngram_seeded_sampling_is_deterministic(text_model):
    spec = LLM(text_model, dtype="float32", num_kv_blocks=128, speculative_config=NGRAM)
    sp = SamplingParams(temperature=0.7, seed=5, max_tokens=16, ignore_eos=True)
    prompts = copy_heavy_prompts(3, seed=2)
    a = [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)]
    assert a == b and all(len(t) == 16 for t in a)


def test_ngram_on_vlm_with_images(tmp_path_factory):
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    model = build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("spec_vl")))
    imgs = [[Image.fromarray(rand_image(56, 56, seed=s))] for s in range(3)]
    prompts = ["red red red square square square red red red square", "one two one two one two", "Describe."]
    base = LLM(model, dtype="float32", num_kv_blocks=128).generate(prompts, _greedy(16), images=imgs, use_tqdm=False)
    spec_llm = LLM(model, dtype="float32", num_kv_blocks=128, speculative_config=NGRAM, max_num_batched_tokens=16)
    spec = spec_llm.generate(prompts, _greedy(16), images=imgs, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    spec_llm.check_integrity()


def test_bad_speculative_config(text_model):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(text_model, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="method"):
        LLM(text_model, speculative_config={"method": "medusa", "num_speculative_tokens": 2})
