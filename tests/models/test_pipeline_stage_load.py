"""A pipeline stage's model, loaded in this process (the stage set by hand, no process group needed): it builds only
its layers (the embeddings on the first stage, the final norm and LM head on the last), reads only their checkpoint
tensors, and they equal the whole model's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vlserve.distributed import parallel_state
from vlserve.distributed.parallel_state import PipelineParallelInfo
from vlserve.models import loader


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from vlserve.demo.checkpoints import build_text_checkpoint

    return {
        tied: build_text_checkpoint(
            str(tmp_path_factory.mktemp(f"pp{tied}")),
            arch="qwen2" if tied else "llama",
            num_layers=4,
            tie_word_embeddings=tied,
        )
        for tied in (True, False)
    }


def _load(model_dir, monkeypatch, stage=None, num_stages=2):
    from transformers import AutoConfig

    if stage is not None:
        monkeypatch.setattr(parallel_state, "_PP", PipelineParallelInfo(stage, num_stages, 1))
    read: list[str] = []
    inner = loader.iter_safetensors_weights

    def recording(*args, **kwargs):
        for name, tensor in inner(*args, **kwargs):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(loader, "iter_safetensors_weights", recording)
    try:
        model = loader.load_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32, "cpu")
    finally:
        monkeypatch.setattr(parallel_state, "_PP", PipelineParallelInfo())
        monkeypatch.setattr(loader, "iter_safetensors_weights", inner)
    return model, read


def load_two_stages(model_dir, monkeypatch) -> SimpleNamespace:
    """The whole model's parameters, and each of two stages' model, parameters and tensor names read."""
    full, _ = _load(model_dir, monkeypatch)
    first, read0 = _load(model_dir, monkeypatch, stage=0)
    last, read1 = _load(model_dir, monkeypatch, stage=1)
    return SimpleNamespace(
        whole=dict(full.named_parameters()),
        first=first,
        last=last,
        read0=read0,
        read1=read1,
        p0=dict(first.named_parameters()),
        p1=dict(last.named_parameters()),
    )


def assert_stage_params_are_the_models(stages: SimpleNamespace, embed_name: str, tied: bool) -> None:
    """Every stage parameter equals the whole model's (a tied LM head: the embeddings)."""
    for name, param in list(stages.p0.items()) + list(stages.p1.items()):
        want = stages.whole[embed_name] if (tied and name == "lm_head.weight") else stages.whole[name]
        assert torch.equal(param, want), name


@pytest.mark.parametrize("tied", [True, False])
def test_stages_hold_and_read_only_their_layers(ckpts, tied, monkeypatch):
    stages = load_two_stages(ckpts[tied], monkeypatch)
    p0, p1, read0, read1 = stages.p0, stages.p1, stages.read0, stages.read1
    layers = {n.split(".")[2] for n in list(p0) + list(p1) if n.startswith("model.layers.")}
    assert layers == {"0", "1", "2", "3"}
    assert {n.split(".")[2] for n in p0 if n.startswith("model.layers.")} == {"0", "1"}
    assert "model.embed_tokens.weight" in p0 and "lm_head.weight" not in p0 and "model.norm.weight" not in p0
    assert "model.embed_tokens.weight" not in p1 and {"lm_head.weight", "model.norm.weight"} <= set(p1)
    assert_stage_params_are_the_models(stages, "model.embed_tokens.weight", tied)
    assert not any(n.startswith(("model.layers.2.", "model.layers.3.", "model.norm.", "lm_head.")) for n in read0)
    assert not any(n.startswith(("model.layers.0.", "model.layers.1.")) for n in read1)
    # the last stage reads the embeddings only when its LM head is tied to them
    assert ("model.embed_tokens.weight" in read1) == tied


def test_middle_stage_has_neither_embeddings_nor_head(ckpts, monkeypatch):
    middle, read = _load(ckpts[False], monkeypatch, stage=1, num_stages=3)  # 4 layers over 3 stages: 2, 1, 1
    names = set(dict(middle.named_parameters()))
    assert {n.split(".")[2] for n in names} == {"2"} and all(n.startswith("model.layers.2.") for n in names)
    assert all(n.startswith("model.layers.2.") for n in read)
