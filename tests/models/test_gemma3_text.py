"""Gemma 3's text decoder (`Gemma3ForCausalLM`) against HF transformers: a tiny random model with 3 sliding layers
(window 8) and a full one whose RoPE is linearly scaled, logits over a paged KV cache and greedy tokens through
vlserve.LLM (whole and chunked prefill, tensor parallel); breaking any one Gemma specific makes the logits differ."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from transformers import AutoConfig

from tests.support.gemma3_checkpoints import build_gemma3_text_checkpoint
from tests.support.hf_generate import hf_greedy_continuations
from tests.support.paged_runner import PagedRunner
from vlserve import LLM, SamplingParams
from vlserve.models import load_model
from vlserve.models.gemma3 import GemmaRMSNorm, ScaledEmbedding
from vlserve.models.hf_config import layer_type_rope_params_of, rope_params_of, sliding_window_of
from vlserve.models.layers import RMSNorm

pytestmark = pytest.mark.hf_parity  # also run on transformers 4.57 (make test-hf4)

ATOL = RTOL = 1e-4
MAX_NEW = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_gemma3_text_checkpoint(str(tmp_path_factory.mktemp("gemma3")))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (40, 37, 44)]


@pytest.fixture(scope="module")
def hf_greedy(model_dir, prompts):
    """HF's greedy continuations of the prompts."""
    return hf_greedy_continuations(model_dir, prompts, MAX_NEW, attn_implementation="eager")


def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _with_config(model_dir: str, out_dir: str, **changes) -> str:
    """A copy of the checkpoint with `changes` written into config.json."""
    shutil.copytree(model_dir, out_dir)
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return out_dir


def _paged_logits(model, cfg, prompt: list[int], decodes: list[int]) -> torch.Tensor:
    """Prefill `prompt` then decode `decodes` one by one over the paged cache -> logits `[len(prompt) + n, V]`."""
    runner = PagedRunner(model, cfg, block_size=4)
    out = [runner.step([("s", prompt)])["s"]]
    out += [runner.step([("s", [t])])["s"] for t in decodes]
    return torch.cat(out)


def _hf_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def _vlserve_greedy(model_dir: str, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, max_model_len=256, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_config_reading(model_dir):
    cfg = AutoConfig.from_pretrained(model_dir)
    assert [sliding_window_of(cfg, i) for i in range(4)] == [8, 8, 8, None]
    full, local = (layer_type_rope_params_of(cfg, t) for t in ("full_attention", "sliding_attention"))
    assert (full.rope_type, full.theta, full.scaling) == ("linear", 1e6, {"factor": 2.0})
    assert (local.rope_type, local.theta, local.scaling) == ("default", 1e4, {})
    from transformers import LlamaConfig

    llama = LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_theta=5e5)
    assert layer_type_rope_params_of(llama, "sliding_attention") == rope_params_of(llama)  # one RoPE for all
    model = load_model(model_dir, cfg, torch.float32, "cpu")
    tables = [layer.self_attn.rotary[0] for layer in model.model.layers]
    assert tables[0] is tables[1] is tables[2] is model.model.rotary_emb["sliding_attention"]
    assert tables[3] is model.model.rotary_emb["full_attention"]
    assert not torch.equal(tables[0].cos_cache, tables[3].cos_cache)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_paged_logits_match_hf(model_dir, prompts, tmp_path, softcap):
    """Prefill + 6 decode steps, logits within 1e-4 of HF's; with `final_logit_softcapping` too."""
    d = model_dir if softcap is None else _with_config(model_dir, str(tmp_path / "m"), final_logit_softcapping=softcap)
    cfg = AutoConfig.from_pretrained(d)
    ref, ours = _hf_model(d), load_model(d, cfg, torch.float32, "cpu")
    decodes = [5, 77, 300, 12, 9, 401]
    want = _hf_logits(ref, prompts[0] + decodes)
    torch.testing.assert_close(_paged_logits(ours, cfg, prompts[0], decodes), want, atol=ATOL, rtol=RTOL)
    if softcap is not None:
        assert want.abs().max() <= softcap


@pytest.mark.parametrize("chunked", [False, True])
def test_greedy_matches_hf(model_dir, prompts, hf_greedy, chunked):
    got = _vlserve_greedy(model_dir, prompts, **({"max_num_batched_tokens": 8} if chunked else {}))
    for i, (g, e) in enumerate(zip(got, hf_greedy)):
        assert g == e, f"prompt {i} diverged: {g} vs HF {e}"
    assert len(set(hf_greedy[0])) > 3  # the oracle is not degenerate


@pytest.mark.slow
def test_greedy_matches_hf_tensor_parallel(model_dir, prompts, hf_greedy):
    got = _vlserve_greedy(model_dir, prompts, max_num_batched_tokens=8, tensor_parallel_size=2)
    assert got == hf_greedy


def _break(name: str, model, monkeypatch) -> None:
    """Undo one Gemma specific in the loaded `model` (restored by monkeypatch at the test's end)."""
    dec = model.model
    if name == "norm_weight":  # weight instead of (1 + weight)
        monkeypatch.setattr(GemmaRMSNorm, "_norm", RMSNorm._norm)
    elif name == "embed_scale":
        monkeypatch.setattr(dec.embed_tokens, "rounded_scale", 1.0)
    elif name == "attn_scale":  # head_dim ** -0.5 instead of query_pre_attn_scalar ** -0.5
        for layer in dec.layers:
            monkeypatch.setattr(layer.self_attn, "scale", layer.self_attn.head_dim**-0.5)
    elif name == "local_rope":  # the sliding layers take the global table
        for layer in dec.layers:
            monkeypatch.setattr(layer.self_attn, "rotary", [dec.rotary_emb["full_attention"]])
    elif name == "window":
        for layer in dec.layers:
            monkeypatch.setattr(layer.self_attn, "sliding_window", None)
    elif name == "post_norms":  # Llama's block: no norms on the attention / MLP outputs
        for layer in dec.layers:
            monkeypatch.setattr(layer, "post_attention_layernorm", torch.nn.Identity())
            monkeypatch.setattr(layer, "post_feedforward_layernorm", torch.nn.Identity())
    else:
        raise AssertionError(name)


@pytest.mark.parametrize("broken", ["norm_weight", "embed_scale", "attn_scale", "local_rope", "window", "post_norms"])
def test_breaking_a_gemma_specific_changes_logits(model_dir, prompts, monkeypatch, broken):
    cfg = AutoConfig.from_pretrained(model_dir)
    ours = load_model(model_dir, cfg, torch.float32, "cpu")
    want = _hf_logits(_hf_model(model_dir), prompts[0])
    torch.testing.assert_close(_paged_logits(ours, cfg, prompts[0], []), want, atol=ATOL, rtol=RTOL)
    _break(broken, ours, monkeypatch)
    assert not torch.allclose(_paged_logits(ours, cfg, prompts[0], []), want, atol=1e-2, rtol=1e-2)


def test_embedding_scale_is_rounded_to_the_model_dtype():
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        emb = ScaledEmbedding(4, 3072)
    finally:
        torch.set_default_dtype(prev)
    assert emb.rounded_scale == 55.5  # sqrt(3072) = 55.43 in bfloat16, as HF scales
    emb.float()
    emb.init_buffers()
    assert emb.rounded_scale == pytest.approx(3072**0.5)


@pytest.mark.parametrize("bad", [{"attn_logit_softcapping": 50.0}, {"use_bidirectional_attention": True}])
def test_unsupported_settings_are_refused(model_dir, tmp_path, bad):
    d = _with_config(model_dir, str(tmp_path / "m"), **bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        load_model(d, AutoConfig.from_pretrained(d), torch.float32, "cpu")
