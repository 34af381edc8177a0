"""KV transfer configuration errors (ValueError naming what is wrong), the serve flags, and the stable block keys
(the same in every process, different for different media)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vlserve.config import EngineArgs, KVTransferConfig
from vlserve.core.kv_cache_manager import block_extra_keys
from vlserve.core.request import EngineCoreRequest, Request
from vlserve.distributed.kv_transfer.offloading.keys import block_key, extend_block_keys, namespace_key
from vlserve.multimodal.inputs import MultiModalFeature
from vlserve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "value, words",
    [
        ({"kv_connector": "OffloadingConnector", "kv_role": "kv_sideways"}, ["kv_role", "kv_sideways"]),
        ({"kv_role": "kv_both"}, ["kv_connector"]),
        ({"kv_connector": "OffloadingConnector", "role": "kv_both"}, ["unknown keys", "role"]),
        ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": [1]}, ["kv_connector_extra_config"]),
        ("{not json", ["not valid JSON"]),
        (["OffloadingConnector"], ["JSON object"]),
    ],
)
def test_bad_kv_transfer_config(value, words):
    with pytest.raises(ValueError) as e:
        EngineArgs(kv_transfer_config=value)
    for w in words:
        assert w in str(e.value)


def test_offloading_flags_make_the_offloading_connector():
    args = EngineArgs(kv_offloading_size=2, kv_offloading_dir="/tmp/x")
    cfg = args.kv_transfer_config
    assert (cfg.kv_connector, cfg.kv_role) == ("OffloadingConnector", "kv_both")
    assert cfg.kv_connector_extra_config == {"cpu_bytes_to_use": 2 << 30, "disk_dir": "/tmp/x"}
    with pytest.raises(ValueError, match="SomeP2PConnector"):
        EngineArgs(kv_offloading_size=1, kv_transfer_config={"kv_connector": "SomeP2PConnector"})
    with pytest.raises(ValueError, match="kv_offloading_size"):
        EngineArgs(kv_offloading_size=-1)
    args = EngineArgs(kv_offloading_dir="/tmp/x", kv_offloading_dir_size=0.5)
    assert args.kv_transfer_config.kv_connector_extra_config == {
        "cpu_bytes_to_use": 0,
        "disk_dir": "/tmp/x",
        "disk_bytes_to_use": 1 << 29,
    }
    for bad in (0, -1, "big", True):
        with pytest.raises(ValueError, match="kv_offloading_dir_size"):
            EngineArgs(kv_offloading_dir="/tmp/x", kv_offloading_dir_size=bad)
    with pytest.raises(ValueError, match="kv_offloading_dir too"):
        EngineArgs(kv_offloading_size=1, kv_offloading_dir_size=1)


def test_unknown_connector_and_unsupported_layouts_refused_before_loading(tmp_path):
    from vlserve import LLM

    with pytest.raises(ValueError, match="NoSuchConnector"):  # the model path is never read
        LLM(str(tmp_path / "missing"), kv_transfer_config={"kv_connector": "NoSuchConnector"})
    with pytest.raises(ValueError, match="one rank"):
        LLM(str(tmp_path / "missing"), kv_offloading_size=1, tensor_parallel_size=2)


def test_offloading_without_a_tier_is_refused():
    from vlserve.distributed.kv_transfer.base import KVConnectorRole
    from vlserve.distributed.kv_transfer.factory import create_connector

    cfg = KVTransferConfig("OffloadingConnector", "kv_both", {"_num_cpu_blocks": 0})
    with pytest.raises(ValueError, match="host tier"):
        create_connector(cfg, KVConnectorRole.SCHEDULER, block_size=16, extra_keys_of=block_extra_keys)


def test_serve_flags_reach_engine_args():
    from vlserve.cli import build_parser, serve_config_from_args

    ns = build_parser().parse_args(
        [
            "serve",
            "m",
            "--kv-transfer-config",
            '{"kv_connector": "OffloadingConnector", "kv_role": "kv_consumer", '
            '"kv_connector_extra_config": {"disk_dir": "/tmp/kv"}}',
            "--kv-offloading-size",
            "0.5",
        ]
    )
    engine_args, _ = serve_config_from_args(ns)
    cfg = engine_args.kv_transfer_config
    assert cfg.kv_role == "kv_consumer" and not cfg.is_producer and cfg.is_consumer
    assert cfg.kv_connector_extra_config == {"cpu_bytes_to_use": 1 << 29, "disk_dir": "/tmp/kv"}


def _request(tokens, features=()):
    return Request(EngineCoreRequest("r", list(tokens), SamplingParams(max_tokens=1), 0.0, list(features)), 1)


def test_keys_fold_in_media_hashes():
    """Same tokens, two different images at 20..27: the keys agree before the image's first block and differ from
    it on (so two images never share a tier block); text-only blocks match a text-only request's."""
    ns = namespace_key("model")
    tokens = list(range(100, 164))  # 4 blocks of 16
    a = _request(tokens, [MultiModalFeature("image", "hash-a", 20, 8)])
    b = _request(tokens, [MultiModalFeature("image", "hash-b", 20, 8)])
    plain = _request(tokens)
    ka, kb, kp = (extend_block_keys(r, 4, 16, ns, block_extra_keys) for r in (a, b, plain))
    assert ka[0] == kb[0] == kp[0]
    assert ka[1] != kb[1] and ka[1] != kp[1]
    assert all(x != y for x, y in zip(ka[1:], kb[1:]))  # chained: every later block differs too
    assert extend_block_keys(_request(tokens[:40]), 4, 16, ns, block_extra_keys) == kp[:2]  # full blocks only
    assert block_key(namespace_key("other model"), tokens[:16]) != kp[0]


def test_keys_are_stable_across_processes():
    code = (
        "import sys; from vlserve.distributed.kv_transfer.offloading.keys import block_key, namespace_key; "
        "k = block_key(namespace_key('m'), list(range(16)), ('an-mm-hash', 'lora:3')); "
        "print(k.hex(), hash(('an-mm-hash',)))"
    )
    outs = []
    for seed in ("1", "2"):
        run = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
        )
        outs.append(run.stdout.split())
    assert outs[0][0] == outs[1][0]  # the tier key
    assert outs[0][1] != outs[1][1]  # what the device prefix cache uses differs per process


def test_readme_kv_transfer_configs_parse_as_written():
    """Every `--kv-transfer-config '...'` the README shows reaches EngineArgs as a config with the connector it names,
    and the README does not promise a default connector the code does not have."""
    import json
    import os
    import re
    import shlex

    from vlserve.cli import build_parser, serve_config_from_args

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    values = [shlex.split(m.group(0))[1] for m in re.finditer(r"--kv-transfer-config '[^']*'", readme)]
    assert len(values) >= 2, "the README's P/D commands give --kv-transfer-config"
    for value in values:
        ns = build_parser().parse_args(["serve", "m", "--kv-transfer-config", value])
        cfg = serve_config_from_args(ns)[0].kv_transfer_config
        assert cfg.kv_connector == json.loads(value)["kv_connector"]
    assert "may be left out" not in readme
    ns = build_parser().parse_args(["serve", "m", "--kv-transfer-config", '{"kv_role": "kv_producer"}'])
    with pytest.raises(ValueError, match="needs kv_connector"):
        serve_config_from_args(ns)
