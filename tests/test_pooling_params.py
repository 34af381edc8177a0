"""PoolingParams / PoolerConfig checks, the runner choice and `finish_pooled` (no model)."""

from __future__ import annotations

import pytest
import torch

from vlserve.config import EngineArgs
from vlserve.engine.pooling import check_pooling_params, finish_pooled
from vlserve.pooling_params import PoolerConfig, PoolerSpec, PoolingParams


@pytest.mark.parametrize(
    "params, match",
    [
        (PoolingParams(task="generate"), "pooling task"),
        (PoolingParams(dimensions=0), "dimensions"),
        (PoolingParams(dimensions=True), "dimensions"),
        (PoolingParams(task="classify", dimensions=8), "embeddings only"),
        (PoolingParams(normalize="yes"), "normalize"),
    ],
)
def test_pooling_params_verify(params, match):
    with pytest.raises(ValueError, match=match):
        params.verify()


def test_pooler_config_parsing():
    assert PoolerConfig.from_any('{"pooling_type": "mean"}').pooling_type == "MEAN"
    assert PoolerConfig.from_any(None) == PoolerConfig()
    for bad, match in [
        ('{"pooling_type": "MAX"}', "pooling_type"),
        ('{"pool": "LAST"}', "unknown pooler_config keys"),
        ("[1]", "JSON object"),
        ("{", "valid JSON"),
        ('{"classifier_from_token": ["a", "b", "c"]}', "one or two"),
    ]:
        with pytest.raises(ValueError, match=match):
            PoolerConfig.from_any(bad)


def test_engine_args_runner_checks():
    with pytest.raises(ValueError, match="runner must be"):
        EngineArgs(runner="embed")
    with pytest.raises(ValueError, match="convert must be"):
        EngineArgs(convert="reward")
    with pytest.raises(ValueError, match="use runner='pooling'"):
        EngineArgs(runner="generate", convert="embed")


def test_check_pooling_params_against_the_engine():
    embed = PoolerSpec()
    with pytest.raises(ValueError, match="generates text"):
        check_pooling_params(PoolingParams(), None, 64)
    with pytest.raises(ValueError, match="not served"):
        check_pooling_params(PoolingParams(task="score"), embed, 64)
    with pytest.raises(ValueError, match="Matryoshka"):
        check_pooling_params(PoolingParams(dimensions=8), embed, 64)
    any_dims = PoolerSpec(is_matryoshka=True)
    check_pooling_params(PoolingParams(dimensions=8), any_dims, 64)
    with pytest.raises(ValueError, match="exceeds"):
        check_pooling_params(PoolingParams(dimensions=65), any_dims, 64)


def test_finish_pooled():
    data = torch.tensor([3.0, 4.0, 12.0])
    spec = PoolerSpec()
    assert torch.allclose(finish_pooled(data, PoolingParams(), spec), data / 13)
    assert torch.allclose(finish_pooled(data, PoolingParams(dimensions=2), spec), torch.tensor([0.6, 0.8]))
    assert torch.equal(finish_pooled(data, PoolingParams(normalize=False), spec), data)
    assert torch.equal(finish_pooled(data, PoolingParams(task="encode"), spec), data)
    cls = PoolerSpec(normalize=False, task="classify")
    assert torch.allclose(finish_pooled(data, PoolingParams(task="classify"), cls), torch.softmax(data, -1))
    one = torch.tensor([0.5])
    assert torch.allclose(finish_pooled(one, PoolingParams(task="score"), cls), torch.sigmoid(one))
    assert torch.equal(finish_pooled(one, PoolingParams(task="score", activation=False), cls), one)


def test_hf_overrides_for_rerankers():
    args = EngineArgs(
        hf_overrides={
            "architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": ["no", "yes"],
            "is_original_qwen3_reranker": True,
        }
    )
    assert args.convert == "classify" and args.pooler_config.classifier_from_token == ["no", "yes"]
    with pytest.raises(ValueError, match="not supported"):
        EngineArgs(hf_overrides={"rope_theta": 1.0})
    with pytest.raises(ValueError, match="two tokens"):
        EngineArgs(hf_overrides={"is_original_qwen3_reranker": True})
    with pytest.raises(ValueError, match="contradicts"):
        EngineArgs(convert="embed", hf_overrides={"architectures": ["Qwen3ForSequenceClassification"]})


def test_serve_flags_reach_engine_args():
    import argparse

    from vlserve.cli import serve_config_from_args
    from vlserve.serve_args import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    flags = ["m", "--runner", "pooling", "--convert", "embed", "--pooler-config", '{"pooling_type": "mean"}']
    engine_args, _ = serve_config_from_args(parser.parse_args(flags))
    assert (engine_args.runner, engine_args.convert, engine_args.pooler_config.pooling_type) == (
        "pooling",
        "embed",
        "MEAN",
    )


def test_pooling_engine_args():
    from vlserve.engine.pooling import pooling_engine_args

    args = EngineArgs(convert="embed")
    assert pooling_engine_args(args, None) is args
    assert pooling_engine_args(args, PoolerSpec()).enable_prefix_caching  # LAST: prefix hits are fine
    assert not pooling_engine_args(args, PoolerSpec(pooling_type="MEAN")).enable_prefix_caching
    with pytest.raises(ValueError, match="async_scheduling"):
        pooling_engine_args(EngineArgs(convert="embed", async_scheduling=True), PoolerSpec())
    with pytest.raises(ValueError, match="speculative_config"):
        pooling_engine_args(EngineArgs(speculative_config={"method": "ngram"}), PoolerSpec())
