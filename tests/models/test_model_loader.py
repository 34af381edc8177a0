"""Loader and registry behaviour: sharded checkpoints, dtypes, tied weights, clear errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from vlserve.demo.checkpoints import build_text_checkpoint
from vlserve.kernels.cpu_linear import cpu_linear_kernel
from vlserve.models import get_model_class, load_model, register_model, supported_architectures
from vlserve.models.causal_lm import LlamaForCausalLM, Qwen2ForCausalLM
from vlserve.models.loader import resolve_dtype
from vlserve.models.parallel_layers import pack_linears_for_cpu


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """A tiny tied-embedding Qwen2 checkpoint (float32)."""
    return build_text_checkpoint(str(tmp_path_factory.mktemp("qwen2")), "qwen2")


def _logits(model, cfg, runner_cls, ids, dtype=torch.float32):
    return runner_cls(model, cfg, dtype=dtype).step([("x", ids)])["x"]


def test_checkpoint_layout(qwen2_dir):
    files = set(os.listdir(qwen2_dir))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    gen = json.load(open(os.path.join(qwen2_dir, "generation_config.json")))
    cfg = AutoConfig.from_pretrained(qwen2_dir)
    assert gen["eos_token_id"] == cfg.eos_token_id is not None
    assert "lm_head.weight" not in load_file(os.path.join(qwen2_dir, "model.safetensors"))  # tied


def test_sharded_checkpoint_matches_single_file(qwen2_dir, tmp_path, paged_runner, load_hf, prompts):
    ref = load_hf(qwen2_dir)
    ref.save_pretrained(tmp_path, max_shard_size="60KB", safe_serialization=True)
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert not os.path.exists(tmp_path / "model.safetensors")
    cfg = AutoConfig.from_pretrained(qwen2_dir)
    single = load_model(qwen2_dir, cfg, torch.float32, "cpu")
    sharded = load_model(str(tmp_path), cfg, torch.float32, "cpu")
    torch.testing.assert_close(
        _logits(sharded, cfg, paged_runner, prompts[1]), _logits(single, cfg, paged_runner, prompts[1]), atol=0, rtol=0
    )

    shard = sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors"))[-1]
    os.remove(tmp_path / shard)
    with pytest.raises(FileNotFoundError, match=shard):
        load_model(str(tmp_path), cfg, torch.float32, "cpu")


def test_missing_weights_file_is_a_clear_error(qwen2_dir, tmp_path):
    cfg = AutoConfig.from_pretrained(qwen2_dir)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(str(tmp_path), cfg, torch.float32, "cpu")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(str(tmp_path / "nope"), cfg, torch.float32, "cpu")


def test_missing_unexpected_and_misshaped_weights(qwen2_dir, tmp_path):
    cfg = AutoConfig.from_pretrained(qwen2_dir)
    weights = load_file(os.path.join(qwen2_dir, "model.safetensors"))

    def attempt(tensors):
        save_file(tensors, str(tmp_path / "model.safetensors"))
        return load_model(str(tmp_path), cfg, torch.float32, "cpu")

    name = "model.layers.1.self_attn.k_proj.bias"
    with pytest.raises(ValueError, match="missing.*" + name.replace(".", r"\.")):
        attempt({k: v for k, v in weights.items() if k != name})
    with pytest.raises(ValueError, match="unexpected.*extra"):
        attempt({**weights, "model.layers.0.extra.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="shape"):
        attempt({**weights, name: torch.zeros(5)})
    # a tied checkpoint that still stores lm_head.weight is accepted
    model = attempt({**weights, "lm_head.weight": weights["model.embed_tokens.weight"].clone()})
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_untied_checkpoint_requires_lm_head(tmp_path):
    d = build_text_checkpoint(str(tmp_path / "ck"), "llama", tie_word_embeddings=False)
    cfg = AutoConfig.from_pretrained(d)
    weights = load_file(os.path.join(d, "model.safetensors"))
    os.makedirs(tmp_path / "bad")
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, str(tmp_path / "bad/model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model(str(tmp_path / "bad"), cfg, torch.float32, "cpu")


def test_bfloat16_load(qwen2_dir, tmp_path, paged_runner, load_hf, prompts):
    cfg = AutoConfig.from_pretrained(qwen2_dir)
    ids = prompts[1]
    bf = load_model(qwen2_dir, cfg, torch.bfloat16, "cpu")
    assert {p.dtype for p in bf.parameters()} == {torch.bfloat16}
    assert bf.model.rotary_emb.cos_cache.dtype == torch.bfloat16
    out = _logits(bf, cfg, paged_runner, ids, dtype=torch.bfloat16)
    assert out.dtype == torch.float32
    with torch.no_grad():
        ref32 = load_hf(qwen2_dir)(torch.tensor([ids])).logits[0]
        ref16 = load_hf(qwen2_dir, torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    assert (out - ref32).abs().max() < 1.0  # HF bf16 itself is ~0.27 off its fp32 logits here
    assert (out - ref16).abs().max() < 0.5
    assert (out.argmax(-1) == ref32.argmax(-1)).float().mean() > 0.8
    # the engine's runner packs the decoder's projections and the LM head for the bf16 CPU kernel where the CPU has
    # AVX512-BF16: the same logits up to the order of float32 sums
    if cpu_linear_kernel() is not None:
        assert pack_linears_for_cpu(bf) == 4 * cfg.num_hidden_layers + 1
        # the head is tied to the embedding here: the embedding keeps its matrix, the head holds a packed copy
        assert cfg.tie_word_embeddings and bf.lm_head.weight is bf.model.embed_tokens.weight
        assert bf.lm_head.packed_weight is not None
        packed = _logits(bf, cfg, paged_runner, ids, dtype=torch.bfloat16)
        assert (packed - out).abs().max() < 0.1
        assert (packed - ref16).abs().max() < 0.5
        assert (packed.argmax(-1) == out.argmax(-1)).float().mean() > 0.9
    # a bfloat16 checkpoint loads into a float32 model; "auto" picks the checkpoint dtype
    d16 = build_text_checkpoint(str(tmp_path), "qwen2", dtype=torch.bfloat16)
    cfg16 = AutoConfig.from_pretrained(d16)
    assert resolve_dtype("auto", cfg16) == torch.bfloat16
    m32 = load_model(d16, cfg16, "float32", "cpu")
    assert m32.model.embed_tokens.weight.dtype == torch.float32
    assert torch.isfinite(_logits(m32, cfg16, paged_runner, ids)).all()


def test_registry():
    cfg = AutoConfig.for_model("llama")
    cfg.architectures = ["LlamaForCausalLM"]
    assert get_model_class(cfg) is LlamaForCausalLM
    cfg.architectures = ["Qwen2ForCausalLM"]
    assert get_model_class(cfg) is Qwen2ForCausalLM
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2VLForConditionalGeneration"} <= set(
        supported_architectures()
    )

    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        get_model_class(cfg)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model("/nonexistent", cfg, torch.float32, "cpu")
    cfg.architectures = None
    with pytest.raises(ValueError, match="architectures"):
        get_model_class(cfg)

    from vlserve.models import registry
    from vlserve.models.causal_lm import Qwen3ForCausalLM

    register_model("MyTestArchForCausalLM", "vlserve.models.causal_lm:Qwen3ForCausalLM")  # lazy entry
    try:
        cfg.architectures = ["MyTestArchForCausalLM"]
        assert get_model_class(cfg) is Qwen3ForCausalLM
        assert "MyTestArchForCausalLM" in supported_architectures()
    finally:
        registry._REGISTRY.pop("MyTestArchForCausalLM")


def test_resolve_dtype():
    assert resolve_dtype("bf16") == torch.bfloat16 and resolve_dtype(torch.float16) == torch.float16
    assert resolve_dtype("auto", AutoConfig.for_model("llama")) == torch.float32
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int8")


def test_kv_cache_spec():
    from transformers import Qwen2VLConfig

    from vlserve.models import kv_cache_spec

    cfg = AutoConfig.for_model(
        "qwen3", num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, hidden_size=64, head_dim=32
    )
    assert kv_cache_spec(cfg) == (3, 2, 32)
    cfg = AutoConfig.for_model(
        "llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=None, hidden_size=64
    )
    assert kv_cache_spec(cfg) == (2, 4, 16)
    vl = Qwen2VLConfig(
        text_config=dict(num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    )
    assert kv_cache_spec(vl) == (5, 2, 16)
