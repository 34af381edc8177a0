"""Tiny random text checkpoints shared by the engine tests, and an HF greedy oracle."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    from vlserve.demo.checkpoints import build_text_checkpoint

    return build_text_checkpoint(str(tmp_path_factory.mktemp("qwen2")), arch="qwen2", num_layers=2)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    from vlserve.demo.checkpoints import build_text_checkpoint

    return build_text_checkpoint(
        str(tmp_path_factory.mktemp("llama")), arch="llama", num_heads=4, num_kv_heads=1, tie_word_embeddings=False
    )


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF transformers `generate` (greedy, float32, EOS ignored), one prompt at a time: the oracle.

    Runs on the device `LLM(device="auto")` picks (cuda when present), so both sides do the same math.
    """
    from tests.support.hf_generate import hf_greedy_continuations

    return hf_greedy_continuations(model_dir, prompts, max_new_tokens, "cuda" if torch.cuda.is_available() else "cpu")


def varied_prompts(vocab_size: int, lengths=(1, 3, 17, 40, 95, 160), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


def greedy_tokens(llm, prompts, max_new_tokens: int) -> list[list[int]]:
    """`llm`'s greedy continuations of `prompts` (token-id lists), EOS ignored."""
    from vlserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def vocab_size(model_dir: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).vocab_size


def check_exact_with_preemption_and_prefix_hits(
    llm, model_dir: str, prompts, expected, max_new_tokens: int, label: str
) -> None:
    """The distributed engines' shared check: `prompts` (sized to preempt in a small pool) come out as `expected`,
    then two prompts sharing a 70-token prefix equal HF's with >= 4 blocks of prefix hits; integrity after each."""
    got = greedy_tokens(llm, prompts, max_new_tokens)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}) diverged under {label}: {g} vs HF {e}"
    m = llm.get_metrics()
    assert m["vlserve:num_preemptions_total"] > 0
    assert m["vlserve:generation_tokens_total"] == max_new_tokens * len(prompts)
    llm.check_integrity()

    base = varied_prompts(vocab_size(model_dir), lengths=(70,), seed=3)[0]
    shared = [base + tail for tail in varied_prompts(vocab_size(model_dir), lengths=(5, 9), seed=4)]
    want = hf_greedy(model_dir, shared, max_new_tokens)
    assert greedy_tokens(llm, shared[:1], max_new_tokens) == want[:1]
    assert greedy_tokens(llm, shared[1:], max_new_tokens) == want[1:]
    assert llm.get_metrics()["vlserve:prefix_cache_hits_total"] >= 64  # 4 full blocks of the shared prefix
    llm.check_integrity()
