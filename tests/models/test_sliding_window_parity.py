"""Sliding-window layers against HF generate: a tiny random Mistral (every layer slides) and a Qwen2 whose
`layer_types` mix sliding and full layers, greedy through vlserve.LLM token for token (whole and chunked prefill);
the same models without their window give other tokens, so the window is what makes them agree."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.support.hf_generate import hf_greedy_continuations
from vlserve import LLM, SamplingParams
from vlserve.models.hf_config import sliding_window_of

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

MAX_NEW = 16
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
MODELS = {
    # window 8: inside one 16-slot cache block
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=8)),
    # window 20: spans blocks; layers 0 and 2 full, 1 sliding
    "qwen2": (
        "Qwen2Config",
        dict(
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=20,
            max_window_layers=0,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
        ),
    ),
}


def _build(out_dir: str, name: str, seed: int = 0) -> str:
    """A random HF checkpoint (as vlserve.demo.checkpoints builds them: norms and biases randomized too)."""
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    from vlserve.demo.checkpoints import _tokenizer

    tok = _tokenizer()
    cls_name, kw = MODELS[name]
    config = getattr(transformers, cls_name)(
        vocab_size=len(tok),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        **COMMON,
        **kw,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif pname.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir


def _without_window(model_dir: str, out_dir: str) -> str:
    """A copy of the checkpoint whose config.json has no sliding window."""
    shutil.copytree(model_dir, out_dir)
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(sliding_window=None, use_sliding_window=False)
    cfg.pop("layer_types", None)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return out_dir


def _hf_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy_continuations(model_dir, prompts, MAX_NEW, attn_implementation="eager")


def _vlserve_greedy(model_dir: str, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, max_model_len=256, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request, tmp_path_factory):
    """(name, windowed dir, unwindowed dir, prompts, HF's greedy tokens) per model."""
    d = _build(str(tmp_path_factory.mktemp(request.param)), request.param)
    full = _without_window(d, str(tmp_path_factory.mktemp(request.param + "_full") / "m"))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (40, 37, 44)]
    return request.param, d, full, prompts, _hf_greedy(d, prompts)


def test_layers_get_their_window(case):
    from transformers import AutoConfig

    name, d, full, _, _ = case
    windows = [sliding_window_of(AutoConfig.from_pretrained(d), i) for i in range(MODELS[name][1]["num_hidden_layers"])]
    assert windows == ([8, 8] if name == "mistral" else [None, 20, None])
    assert sliding_window_of(AutoConfig.from_pretrained(full), 1) is None


@pytest.mark.parametrize("chunked", [False, True])
def test_greedy_matches_hf(case, chunked):
    _, d, _, prompts, expected = case
    got = _vlserve_greedy(d, prompts, **({"max_num_batched_tokens": 8} if chunked else {}))
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} diverged: {g} vs HF {e}"
    assert len(set(expected[0])) > 3  # the oracle is not degenerate


def test_without_the_window_tokens_differ(case):
    _, _, full, prompts, expected = case
    assert _hf_greedy(full, prompts) != expected
    assert _vlserve_greedy(full, prompts) != expected
