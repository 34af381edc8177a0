"""The committed checkpoints that llm-compressor and GPTQModel wrote (`tests/fixtures/quant`, see its README) against
the greedy references the formats' own libraries computed (`reference.json`, float32):

- text prompts, teacher-forced over the reference's 16 tokens: weight-only schemes pick the reference's token at
  every step whose top-1 / top-2 margin exceeds the numeric noise, with the chosen token's log-probability within
  1e-3; W8A8 INT8 and FP8 (dynamic activations) agree on >= 98% of the top-1 tokens over all prompts, the largest
  log-probability difference printed;
- the Qwen2-VL fixtures' image prompt, through `LLM.generate`: the reference's greedy tokens, up to its first
  near-tie.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from PIL import Image
from transformers import AutoConfig

from tests.support.paged_runner import PagedRunner
from vlserve.models import load_model

ROOT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "quant")
FIXTURES = sorted(d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "reference.json")))
MARGIN = 1e-3  # a reference step whose top-1 and top-2 logits are closer than this is a coin toss in float32


def _reference(name: str) -> dict:
    with open(os.path.join(ROOT, name, "reference.json")) as f:
        return json.load(f)


def _activation_quantized(ref: dict) -> bool:
    return bool(ref.get("activation_quantization"))


def test_every_fixture_is_checked():
    assert len(FIXTURES) >= 12 and {"gptq_4bit_g128_actorder", "awq_4bit_g128", "ct_fp8_block"} <= set(FIXTURES)


@pytest.mark.parametrize("name", FIXTURES)
def test_text_prompts_match_the_format_library(name, capsys):
    ref = _reference(name)
    model_dir = os.path.join(ROOT, name)
    cfg = AutoConfig.from_pretrained(model_dir)
    model = load_model(model_dir, cfg, torch.float32, "cpu")
    results = ref["results"][ref["primary"]]
    agree = total = 0
    worst = 0.0
    for i, (prompt, want) in enumerate(zip(ref["prompts"], results)):
        if prompt.get("image"):
            continue
        runner = PagedRunner(model, cfg)
        ids = prompt["prompt_token_ids"] + want["output_token_ids"][:-1]
        logits = runner.step([("a", ids)])["a"][len(prompt["prompt_token_ids"]) - 1 :]  # [16, V]
        logprobs = logits.log_softmax(-1)
        for step, tok in enumerate(want["output_token_ids"]):
            ours = int(logits[step].argmax())
            diff = abs(float(logprobs[step, tok]) - want["logprobs"][step])
            total += 1
            agree += ours == tok
            worst = max(worst, diff)
            if not _activation_quantized(ref) and want["top2_margins"][step] > MARGIN:
                assert ours == tok, f"{name} prompt {i} step {step}: {ours} != {tok}"
                assert diff < 1e-3, f"{name} prompt {i} step {step}: logprob differs by {diff}"
    with capsys.disabled():
        print(f"\n{name}: top-1 {agree}/{total}, max |logprob diff| {worst:.2e}")
    assert agree / total >= 0.98


@pytest.mark.parametrize("name", [f for f in FIXTURES if f.startswith("ct_vl_")])
def test_image_prompt_matches_through_llm(name):
    from vlserve import LLM, SamplingParams

    ref = _reference(name)
    prompt = next(p for p in ref["prompts"] if p.get("image"))
    want = ref["results"][ref["primary"]][ref["prompts"].index(prompt)]
    image = Image.open(os.path.join(ROOT, name, prompt["image"]["file"])).convert("RGB")
    llm = LLM(os.path.join(ROOT, name), dtype="float32", num_kv_blocks=64)
    out = llm.generate(
        {"prompt": prompt["text"], "multi_modal_data": {"image": image}},
        SamplingParams(max_tokens=len(want["output_token_ids"]), temperature=0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert list(out.prompt_token_ids) == prompt["prompt_token_ids"]
    got = list(out.outputs[0].token_ids)
    certain = next((s for s, m in enumerate(want["top2_margins"]) if m <= MARGIN), len(got))
    if _activation_quantized(ref):
        certain = min(certain, 4)  # fake-quantized activations: the first tokens only
    assert got[: certain + 1] == want["output_token_ids"][: certain + 1]
