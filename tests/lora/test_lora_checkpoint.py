"""Reading PEFT adapter directories: rank / alpha / rslora / rank_pattern / alpha_pattern as PEFT applies them,
VLM key layouts, and every error (missing files, unsupported config, tower targets, rank, shapes, unknown ids)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.lora.lora_helpers import ALL, make_adapter, our_model
from vlserve.demo.checkpoints import build_text_checkpoint
from vlserve.lora import LoRAModelManager, LoRARequest, load_peft_adapter


@pytest.fixture(scope="module")
def base(checkpoint):
    """(model_dir, cfg, manager over our qwen2 model): the manager's targets are what adapters map onto."""
    model_dir, cfg = checkpoint("qwen2")
    return model_dir, cfg, LoRAModelManager(our_model(model_dir, cfg), max_loras=1, max_lora_rank=16)


def _peft_layers(peft_model):
    """{PEFT module key: the PEFT LoRA layer}."""
    return {name: m for name, m in peft_model.base_model.model.named_modules() if hasattr(m, "lora_A")}


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"use_rslora": True},
        {"rank_pattern": {"q_proj": 8, "layers.1.mlp.down_proj": 2}, "alpha_pattern": {"v_proj": 32}},
    ],
    ids=["plain", "rslora", "patterns"],
)
def test_rank_alpha_scaling_as_peft(kw, base, tmp_path):
    model_dir, _, manager = base
    path, ref = make_adapter(model_dir, tmp_path, ALL, r=4, alpha=8, **kw)
    adapter = load_peft_adapter(path, manager.targets, 16, 1)
    layers = _peft_layers(ref)
    assert len(adapter.weights) == len(layers) == 7 * 2
    for key, layer in layers.items():
        rel = key.removeprefix("model.")
        proj = rel.rsplit(".", 1)[1]
        ours = next(w for (m, p), w in adapter.weights.items() if p == proj and m.startswith(rel.rsplit(".", 2)[0]))
        assert adapter.config.rank_alpha(key)[0] == layer.r["default"] == ours.rank
        assert adapter.config.scaling(key) == pytest.approx(layer.scaling["default"])
        torch.testing.assert_close(ours.lora_a, layer.lora_A["default"].weight.detach())
        torch.testing.assert_close(ours.lora_b, layer.lora_B["default"].weight.detach() * layer.scaling["default"])
    if "rank_pattern" in kw:
        assert adapter.rank == 8 and {w.rank for w in adapter.weights.values()} == {2, 4, 8}


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_vlm_language_model_keys(prefix, base, tmp_path):
    model_dir, _, manager = base
    path, _ = make_adapter(model_dir, tmp_path / "a", ["q_proj", "down_proj"])
    want = load_peft_adapter(path, manager.targets, 16)
    tensors = {
        k.replace("base_model.model.model.", "base_model.model." + prefix): v
        for k, v in load_file(os.path.join(path, "adapter_model.safetensors")).items()
    }
    vlm = _copy(path, tmp_path / "vlm", tensors=tensors)
    got = load_peft_adapter(vlm, manager.targets, 16)
    assert got.weights.keys() == want.weights.keys()
    assert all(torch.equal(got.weights[k].lora_b, want.weights[k].lora_b) for k in want.weights)


def _copy(src, dst, config=None, tensors=None):
    """A copy of adapter dir `src` at `dst` with config fields updated and / or the tensors replaced."""
    shutil.copytree(src, dst)
    if config is not None:
        p = os.path.join(dst, "adapter_config.json")
        with open(p) as f:
            cfg = json.load(f)
        cfg.update(config)
        with open(p, "w") as f:
            json.dump(cfg, f)
    if tensors is not None:
        save_file(tensors, os.path.join(dst, "adapter_model.safetensors"))
    return str(dst)


def test_errors(base, tmp_path):
    model_dir, _, manager = base
    path, _ = make_adapter(model_dir, tmp_path / "a", ["q_proj", "o_proj"], r=4)
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    t = manager.targets

    def err(match, p, max_rank=16):
        with pytest.raises(ValueError, match=match):
            load_peft_adapter(p, t, max_rank)

    os.makedirs(tmp_path / "empty")
    err("missing adapter_config.json", str(tmp_path / "empty"))
    no_weights = _copy(path, tmp_path / "nw")
    os.remove(os.path.join(no_weights, "adapter_model.safetensors"))
    err("missing adapter_model.safetensors", no_weights)
    err(r"bias='all' is not supported \(only 'none'\)", _copy(path, tmp_path / "b", {"bias": "all"}))
    err(
        "modules_to_save=.*'lm_head'.* not supported yet", _copy(path, tmp_path / "m", {"modules_to_save": ["lm_head"]})
    )
    err("use_dora=True is not supported", _copy(path, tmp_path / "d", {"use_dora": True}))
    err(
        r"target_modules \['fc1', 'qkv'\] are not supported",
        _copy(path, tmp_path / "t", {"target_modules": ["q_proj", "qkv", "fc1"]}),
    )
    err("rank 4 is above max_lora_rank 2", path, max_rank=2)
    err("rank 4 in the weights, 8 in adapter_config.json", _copy(path, tmp_path / "r", {"r": 8}))
    tower = dict(tensors)
    tower["base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight"] = torch.zeros(4, 32)
    tower["base_model.model.model.visual.blocks.0.attn.qkv.lora_B.weight"] = torch.zeros(96, 4)
    err(
        r"outside the text decoder's projections: \['model.visual.blocks.0.attn.qkv'\]",
        _copy(path, tmp_path / "tw", tensors=tower),
    )
    head = {
        "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
        "base_model.model.lm_head.lora_B.weight": torch.zeros(10, 4),
    }
    err(r"outside the text decoder's projections: \['lm_head'\]", _copy(path, tmp_path / "h", tensors=head))
    err(
        "unsupported tensors",
        _copy(path, tmp_path / "u", tensors={**tensors, "base_model.model.x.bias": torch.zeros(2)}),
    )
    lone = {k: v for k, v in tensors.items() if not (".0.self_attn.q_proj" in k and "lora_B" in k)}
    err("has lora_A without its pair", _copy(path, tmp_path / "p", tensors=lone))
    deep = dict(tensors)
    deep["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 64)
    deep["base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight"] = torch.zeros(64, 4)
    err(
        r"no LoRA-capable layer in this model \(layers.7.self_attn.qkv_proj\)",
        _copy(path, tmp_path / "l", tensors=deep),
    )
    other = build_text_checkpoint(str(tmp_path / "wide"), "qwen2", hidden_size=32, intermediate_size=64)
    wide, _ = make_adapter(other, tmp_path / "w", ["q_proj"])
    err(r"do not fit the base layer \(in 64, out 64\)", wide)
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, path)


def test_regex_target_modules(base, tmp_path):
    model_dir, _, manager = base
    path, _ = make_adapter(model_dir, tmp_path, r".*layers\.1\.(self_attn\.k_proj|mlp\.up_proj)")
    adapter = load_peft_adapter(path, manager.targets, 16)
    assert isinstance(adapter.config.target_modules, str)
    assert sorted(adapter.weights) == [
        ("layers.1.mlp.gate_up_proj", "up_proj"),
        ("layers.1.self_attn.qkv_proj", "k_proj"),
    ]
