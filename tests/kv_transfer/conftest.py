"""Tiny random checkpoints for the KV-connector tests (built once per session)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    from vlserve.testing.checkpoints import build_text_checkpoint

    return build_text_checkpoint(str(tmp_path_factory.mktemp("qwen2")), arch="qwen2", num_layers=2)


@pytest.fixture(scope="session")
def qwen2_vl_dir(tmp_path_factory):
    from vlserve.testing.vl_checkpoints import build_qwen2_vl_checkpoint

    return build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("qwen2_vl")), variant="qwen2_vl")
