"""The transfer connectors' configs, spelled as vLLM's `--kv-transfer-config` and `--ec-transfer-config` (re-exported
by vlserve.config)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

from vlserve.shorten import shorten


def _from_any(cls, value, name: str, required: str, example: str):
    """`cls` from the dataclass, its dict or its JSON text (None stays None); unknown keys are a ValueError naming
    `name`."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {shorten(value)}")
    unknown = set(value) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"{name} has unknown keys: {', '.join(sorted(unknown))}")
    if required not in value:
        raise ValueError(f"{name} needs {required} (e.g. {example})")
    return cls(**value)


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """The KV connector, spelled as vLLM's `--kv-transfer-config`: `kv_connector` names a class the connector factory
    knows (vlserve/distributed/kv_transfer/factory.py), `kv_role` says whether this engine saves KV (producer),
    loads it (consumer) or both, `kv_connector_extra_config` is the connector's own settings."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError(f"kv_transfer_config.kv_connector must name a connector, got {shorten(self.kv_connector)}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(
                f"kv_transfer_config.kv_role must be one of {', '.join(KV_ROLES)}, got {shorten(self.kv_role)}"
            )
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(
                f"kv_transfer_config.kv_connector_extra_config must be a JSON object, "
                f"got {shorten(self.kv_connector_extra_config)}"
            )

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_any(cls, value: KVTransferConfig | dict | str | None) -> KVTransferConfig | None:
        """From the dataclass, its dict or its JSON text (None stays None); unknown keys are a ValueError."""
        return _from_any(cls, value, "kv_transfer_config", "kv_connector", '"OffloadingConnector"')


EC_ROLES = ("ec_producer", "ec_consumer", "ec_both")
EC_CONNECTORS = {"shared_storage": "shared_storage", "ECSharedStorageConnector": "shared_storage"}  # vLLM's names


@dataclass
class ECTransferConfig:
    """The encoder-cache connector, spelled as vLLM's `--ec-transfer-config`: `ec_connector` ("shared_storage", or
    vLLM's class name "ECSharedStorageConnector"), `ec_role` (a producer writes the encoder outputs it computes, a
    consumer loads them instead of running the tower, both does both), `ec_connector_extra_config`
    ({"shared_storage_path": DIR}). See vlserve/distributed/ec_transfer/."""

    ec_connector: str
    ec_role: str = "ec_both"
    ec_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ec_connector not in EC_CONNECTORS:
            raise ValueError(
                f"ec_transfer_config.ec_connector must be one of {', '.join(EC_CONNECTORS)}, "
                f"got {shorten(self.ec_connector)}"
            )
        self.ec_connector = EC_CONNECTORS[self.ec_connector]
        if self.ec_role not in EC_ROLES:
            raise ValueError(
                f"ec_transfer_config.ec_role must be one of {', '.join(EC_ROLES)}, got {shorten(self.ec_role)}"
            )
        extra = self.ec_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError(
                f"ec_transfer_config.ec_connector_extra_config must be a JSON object, got {shorten(extra)}"
            )
        path = extra.get("shared_storage_path")
        if not isinstance(path, str) or not path:
            raise ValueError(
                f"ec_transfer_config.ec_connector_extra_config.shared_storage_path must name a "
                f"directory, got {shorten(path)}"
            )
        unknown = set(extra) - {"shared_storage_path", "_namespace"}
        if unknown:
            raise ValueError(
                f"ec_transfer_config.ec_connector_extra_config has unknown keys: {', '.join(sorted(unknown))}"
            )
        self.ec_connector_extra_config = {**extra, "shared_storage_path": os.path.expanduser(path)}

    @property
    def is_producer(self) -> bool:
        return self.ec_role in ("ec_producer", "ec_both")

    @property
    def is_consumer(self) -> bool:
        return self.ec_role in ("ec_consumer", "ec_both")

    @classmethod
    def from_any(cls, value: ECTransferConfig | dict | str | None) -> ECTransferConfig | None:
        """From the dataclass, its dict or its JSON text (None stays None); unknown keys are a ValueError."""
        return _from_any(cls, value, "ec_transfer_config", "ec_connector", '"shared_storage"')
