"""A compressed-tensors FP8_DYNAMIC Qwen2 (float8_e4m3fn weights with a scale per channel, activations quantized per
token at run time) served through `LLM`: a prompt's log-probabilities are the same alone and inside batches of
other prompts, at any position, in float32 and bf16 (per-token scales make every row independent)."""

from __future__ import annotations

import pytest
import torch

from tests.support.quant_checkpoints import quantize_checkpoint
from vlserve.demo.checkpoints import build_text_checkpoint


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8rows")
    base = build_text_checkpoint(
        str(root / "base"),
        arch="qwen2",
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        tie_word_embeddings=False,
    )
    return quantize_checkpoint(base, str(root / "q"), "ct-fp8")


def _logprobs(llm, prompts: list[list[int]]) -> list[list[dict[int, float]]]:
    from vlserve import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs]


def _max_diff(a: list[dict[int, float]], b: list[dict[int, float]]) -> float:
    assert [set(s) for s in a] == [set(s) for s in b]  # the same tokens in the top 5 at every step
    return max(abs(x[t] - y[t]) for x, y in zip(a, b, strict=True) for t in x)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_logprobs_do_not_depend_on_the_batch(fp8_dir, dtype):
    from vlserve import LLM

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 600, (int(n),), generator=g).tolist() for n in torch.randint(5, 30, (8,), generator=g)]
    # no prefix caching: a cached prefix reads its keys through another attention path, whose float32 rounding
    # differs at the 1e-6 level; this test is about the batch around a prompt
    llm = LLM(fp8_dir, dtype=dtype, num_kv_blocks=128, enable_prefix_caching=False)
    alone = [_logprobs(llm, [p])[0] for p in prompts]
    diffs = {"all 8": max(_max_diff(a, b) for a, b in zip(alone, _logprobs(llm, prompts), strict=True))}
    for size, pos in ((2, 1), (3, 0), (3, 2), (8, 5)):
        others = prompts[1:size]
        batch = others[:pos] + [prompts[0]] + others[pos:]
        diffs[f"{size} at {pos}"] = _max_diff(alone[0], _logprobs(llm, batch)[pos])
    # float32 rounding of the log-softmax is all that may differ
    assert max(diffs.values()) <= 1e-6, f"max |logprob alone - in a batch|: {diffs}"
