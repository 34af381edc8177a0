"""Shared fixtures: tiny Qwen2-VL / Qwen2.5-VL checkpoints built once per session, media generators."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def qwen2_vl_dir(tmp_path_factory):
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    return build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("qwen2_vl")), variant="qwen2_vl")


@pytest.fixture(scope="session")
def qwen2_5_vl_dir(tmp_path_factory):
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    return build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("qwen2_5_vl")), variant="qwen2_5_vl")


@pytest.fixture(scope="session", params=["qwen2_vl", "qwen2_5_vl"])
def vl_dir(request):
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture(scope="session")
def audio_dir(tmp_path_factory):
    from tests.support.audio_checkpoints import build_qwen2_audio_checkpoint

    return build_qwen2_audio_checkpoint(str(tmp_path_factory.mktemp("qwen2_audio")))
