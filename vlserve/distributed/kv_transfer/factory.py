"""Builds the connector a KVTransferConfig names (vLLM's KVConnectorFactory): name -> (module, class), imported
only when used, so the scheduler's process never imports a connector it does not run."""

from __future__ import annotations

import importlib

from vlserve.distributed.kv_transfer.base import KVConnectorBase, KVConnectorRole

_REGISTRY: dict[str, tuple[str, str]] = {
    "OffloadingConnector": ("vlserve.distributed.kv_transfer.offloading.connector", "OffloadingConnector"),
    "P2PConnector": ("vlserve.distributed.kv_transfer.p2p.connector", "P2PConnector"),
}


def register_connector(name: str, module: str, class_name: str) -> None:
    """Make `name` buildable (a connector outside vlserve registers itself this way)."""
    _REGISTRY[name] = (module, class_name)


def known_connectors() -> list[str]:
    return sorted(_REGISTRY)


def check_kv_transfer_config(config) -> None:
    """ValueError naming the connector when no connector of that name is registered."""
    if config is not None and config.kv_connector not in _REGISTRY:
        raise ValueError(
            f"unknown KV connector {config.kv_connector!r} in kv_transfer_config; known: "
            f"{', '.join(known_connectors())}"
        )


def create_connector(config, role: KVConnectorRole, **context) -> KVConnectorBase | None:
    """The connector `config` names, for `role` (None when config is None)."""
    if config is None:
        return None
    check_kv_transfer_config(config)
    module, class_name = _REGISTRY[config.kv_connector]
    cls = getattr(importlib.import_module(module), class_name)
    return cls(config, role, **context)
