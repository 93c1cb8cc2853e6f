"""KV transfer: a prefix cache on disk, or disaggregated prefill and decode."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from pagellm.config.parse import config_dict
from pagellm.utils import reject_unknown

KV_CONNECTORS = ("DiskConnector", "TcpConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """vLLM's ``kv_transfer_config``: ``kv_connector`` moves K/V between this engine's pool and
    elsewhere (docs/kv_transfer.md). ``DiskConnector``: a persistent prefix cache, with
    ``kv_connector_extra_config={"path": DIR, "max_size_gib": N}`` (default 10). ``TcpConnector``:
    disaggregated prefill/decode; a consumer (decode engine) listens on ``{"host": H, "port": P}``
    (default host 127.0.0.1), keeps up to ``max_size_gib`` (default 1) of pushed blocks and waits
    ``timeout_s`` (default 30) for a request's transfer. ``kv_role``: ``kv_producer`` only saves
    or sends, ``kv_consumer`` only loads, ``kv_both`` does both.
    ``kv_load_failure_policy``: a load that fails is recomputed (``recompute``) or ends the
    request with an error (``fail``)."""

    kv_connector: str = "DiskConnector"
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config kv_connector must be one of {KV_CONNECTORS}, got "
                             f"{self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_transfer_config kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                             f"got {self.kv_load_failure_policy!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config kv_connector_extra_config must be a dict")
        disk = self.kv_connector == "DiskConnector"
        reject_unknown("kv_connector_extra_config field(s)", extra,
                       {"path", "max_size_gib"} if disk else {"host", "port", "max_size_gib", "timeout_s"})
        if disk and (not isinstance(extra.get("path"), str) or not extra["path"]):
            raise ValueError('kv_transfer_config: DiskConnector needs kv_connector_extra_config {"path": DIR}')
        for name in ("max_size_gib", "timeout_s"):
            value = extra.get(name, 1)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"kv_connector_extra_config {name} must be a number >= 0, got {value!r}")
        if not disk and self.loads:
            port = extra.get("port")
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
                raise ValueError("kv_transfer_config: a TcpConnector consumer needs kv_connector_extra_config "
                                 f'{{"port": N}} to listen on (0: any free port), got {port!r}')

    @property
    def path(self) -> str:
        return os.path.abspath(os.path.expanduser(self.kv_connector_extra_config["path"]))

    def store_dir(self, fingerprint: str) -> str:
        """The directory of one engine fingerprint's blocks (foreign blocks never share it)."""
        return os.path.join(self.path, fingerprint[:32])

    @property
    def max_bytes(self) -> int:
        default = 10 if self.kv_connector == "DiskConnector" else 1
        return int(float(self.kv_connector_extra_config.get("max_size_gib", default)) * 2**30)

    @property
    def timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("timeout_s", 30))

    @property
    def saves(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def loads(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_any(cls, value: dict | str | KVTransferConfig | None) -> KVTransferConfig | None:
        if value is None or isinstance(value, cls):
            return value
        return cls(**config_dict(value, "kv_transfer_config", '{"kv_connector": "DiskConnector", '
                                  '"kv_connector_extra_config": {"path": "/var/cache/pagellm-kv"}}', cls))
