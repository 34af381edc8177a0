"""Tiny random checkpoints for the KV-connector tests (built once per session)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    from vlserve.demo.checkpoints import build_text_checkpoint

    return build_text_checkpoint(str(tmp_path_factory.mktemp("qwen2")), arch="qwen2", num_layers=2)


@pytest.fixture(scope="session")
def qwen2_vl_dir(tmp_path_factory):
    from vlserve.demo.vl_checkpoints import build_qwen2_vl_checkpoint

    return build_qwen2_vl_checkpoint(str(tmp_path_factory.mktemp("qwen2_vl")), variant="qwen2_vl")


@pytest.fixture(scope="session")
def mooncake():
    """Mooncake's transfer engine (the `kv` extra), or a skip saying how to get it: importable as installed, or
    from the folder VLSERVE_MOONCAKE_SITE names (e.g. `pip install --no-deps --target /tmp/mooncake-site
    mooncake-transfer-engine-non-cuda` on a host without CUDA, without touching the venv)."""
    import os
    import sys

    site = os.environ.get("VLSERVE_MOONCAKE_SITE")
    if site and site not in sys.path:
        sys.path.append(site)
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        if os.environ.get("VLSERVE_REQUIRE_MOONCAKE") == "1":  # CI: `make setup` installs it, so a skip is a failure
            pytest.fail(f"Mooncake's transfer engine is not importable ({e}) and VLSERVE_REQUIRE_MOONCAKE=1")
        pytest.skip(
            f"Mooncake's transfer engine is not importable ({e}): pip install 'vlserve[kv]', or set "
            f"VLSERVE_MOONCAKE_SITE to a folder holding mooncake-transfer-engine(-non-cuda)"
        )
    return TransferEngine
