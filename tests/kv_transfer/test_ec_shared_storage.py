"""The shared-storage encoder-cache connector (vLLM's --ec-transfer-config): a producer writes each image's encoder
output into a shared directory keyed by mm_hash under a model namespace; a fresh consumer loads it instead of
running the tower, with the same greedy tokens; a missing or bad file is encoded locally."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
from PIL import Image

from vlserve import LLM, SamplingParams
from vlserve.config import ECTransferConfig, EngineArgs

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
TEXT = "Describe the picture in great detail."
KW = dict(dtype="float32", num_kv_blocks=32, block_size=4, max_model_len=128, seed=0)


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 56, 3), dtype=np.uint8))


def _ec(role: str, path) -> dict:
    return {
        "ec_connector": "shared_storage",
        "ec_role": role,
        "ec_connector_extra_config": {"shared_storage_path": str(path)},
    }


def _gen(llm: LLM, img) -> list[int]:
    out = llm.generate(TEXT, GREEDY, images=[img], use_tqdm=False)[0].outputs[0].token_ids
    llm.check_integrity()
    return list(out)


def _files(path) -> set[str]:
    return set(glob.glob(os.path.join(str(path), "*", "*.ect")))


def _m(llm: LLM, name: str) -> float:
    return llm.get_metrics()[f"vlserve:{name}"]


@pytest.mark.slow
def test_ec_both_then_consumer_skips_the_tower(qwen2_vl_dir, tmp_path):
    imgs = [_image(1), _image(2), _image(3)]
    producer = LLM(qwen2_vl_dir, ec_transfer_config=_ec("ec_both", tmp_path), **KW)  # encodes, publishes, generates
    expected, files = [], []
    for img in imgs[:2]:
        before = _files(tmp_path)
        expected.append(_gen(producer, img))
        (new,) = _files(tmp_path) - before  # one checksummed file per item
        files.append(new)
    assert expected[0] != expected[1]  # the images matter
    assert _m(producer, "encoder_runs_total") == 2 and _m(producer, "ec_stores_total") == 2

    consumer = LLM(qwen2_vl_dir, ec_transfer_config=_ec("ec_consumer", tmp_path), **KW)
    assert [_gen(consumer, img) for img in imgs[:2]] == expected
    assert _m(consumer, "encoder_runs_total") == 0  # the tower never ran
    assert _m(consumer, "ec_load_hits_total") == 2
    # an image not in the directory: encoded here (and a consumer writes nothing)
    third = _gen(consumer, imgs[2])
    assert _m(consumer, "encoder_runs_total") == 1 and _m(consumer, "ec_load_misses_total") == 1
    assert len(_files(tmp_path)) == 2
    assert third == _gen(producer, imgs[2])

    # a corrupted file and a truncated one: encoded locally, same tokens, counted
    with open(files[0], "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\xff" * 8)
    with open(files[1], "r+b") as f:
        f.truncate(os.path.getsize(files[1]) - 16)
    fresh = LLM(qwen2_vl_dir, ec_transfer_config=_ec("ec_consumer", tmp_path), **KW)
    assert [_gen(fresh, img) for img in imgs[:2]] == expected
    assert _m(fresh, "encoder_runs_total") == 2 and _m(fresh, "ec_load_failures_total") == 2
    assert _m(fresh, "ec_load_hits_total") == 0


@pytest.mark.slow
def test_ec_namespace_separates_models(qwen2_vl_dir, tmp_path):
    """The same image through the same checkpoint in another dtype: another namespace, no hit."""
    img = _image(4)
    _gen(LLM(qwen2_vl_dir, ec_transfer_config=_ec("ec_both", tmp_path), **KW), img)
    other = LLM(qwen2_vl_dir, ec_transfer_config=_ec("ec_both", tmp_path), **{**KW, "dtype": "bfloat16"})
    _gen(other, img)
    assert _m(other, "ec_load_hits_total") == 0 and _m(other, "encoder_runs_total") == 1
    assert len({os.path.dirname(p) for p in _files(tmp_path)}) == 2
    again = LLM(qwen2_vl_dir, ec_transfer_config=_ec("ec_both", tmp_path), **{**KW, "dtype": "bfloat16"})
    assert _gen(again, img) == _gen(other, img)  # bfloat16 outputs load back in bfloat16
    assert _m(again, "ec_load_hits_total") == 1 and _m(again, "encoder_runs_total") == 0


@pytest.mark.parametrize(
    "value, field",
    [
        ({"ec_connector": "nope", "ec_connector_extra_config": {"shared_storage_path": "/tmp/x"}}, "ec_connector"),
        (
            {
                "ec_connector": "shared_storage",
                "ec_role": "kv_both",
                "ec_connector_extra_config": {"shared_storage_path": "/tmp/x"},
            },
            "ec_role",
        ),
        ({"ec_connector": "shared_storage"}, "shared_storage_path"),
        (
            {"ec_connector": "shared_storage", "ec_connector_extra_config": {"shared_storage_path": 3}},
            "shared_storage_path",
        ),
        ({"ec_connector": "shared_storage", "ec_connector_extra_config": []}, "ec_connector_extra_config"),
        (
            {"ec_connector": "shared_storage", "ec_connector_extra_config": {"shared_storage_path": "/x", "bogus": 1}},
            "bogus",
        ),
        ({"ec_role": "ec_both"}, "ec_connector"),
        ({"ec_connector": "shared_storage", "extra": 1}, "extra"),
        ("{not json", "ec_transfer_config"),
        ("[]", "ec_transfer_config"),
    ],
)
def test_bad_ec_transfer_config_names_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(model="x", ec_transfer_config=value)


def test_ec_transfer_config_parses_as_vllm():
    args = EngineArgs(
        model="x",
        ec_transfer_config='{"ec_connector": "ECSharedStorageConnector", "ec_role": '
        '"ec_consumer", "ec_connector_extra_config": '
        '{"shared_storage_path": "/tmp/ec"}}',
    )
    cfg = args.ec_transfer_config
    assert isinstance(cfg, ECTransferConfig) and cfg.ec_connector == "shared_storage"
    assert cfg.is_consumer and not cfg.is_producer


def test_cli_takes_ec_transfer_config():
    from vlserve.cli import build_parser, serve_config_from_args

    args = build_parser().parse_args(
        [
            "serve",
            "--ec-transfer-config",
            '{"ec_connector": "shared_storage", "ec_role": "ec_producer", '
            '"ec_connector_extra_config": {"shared_storage_path": "/tmp/ec"}}',
        ]
    )
    cfg = serve_config_from_args(args)[0].ec_transfer_config
    assert isinstance(cfg, ECTransferConfig) and cfg.is_producer and not cfg.is_consumer
    assert serve_config_from_args(args)[0].mm_encoder_only  # as vLLM: an ec_producer is an encode server
