"""The connector's settings, read once from vLLM's ``kv_transfer_config``.

``kv_connector_extra_config`` keys (all optional but the secret):

    secret      shared HMAC key of the side channel (or env ``KVBRIDGE_SECRET``)
    host        address P's side channel binds and advertises (default 127.0.0.1)
    port        its port (default 0: any free port)
    lease_s     how long P holds a prefilled request's blocks for D (default 30)
    timeout_s   D's deadline for one request's transfer and for each side-channel call
                to P (handshake, lease, push; default 10)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvbridge.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    engine_id: str
    producer: bool
    consumer: bool
    secret: bytes
    host: str = "127.0.0.1"
    port: int = 0
    lease_s: float = 30.0
    timeout_s: float = 10.0


def read_config(kv_transfer_config: Any) -> ConnectorConfig:
    role = kv_transfer_config.kv_role
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ConfigError(f"kv_role {role!r}: expected kv_producer, kv_consumer or kv_both")
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    secret = str(extra.pop("secret", "") or os.environ.get("KVBRIDGE_SECRET", ""))
    if not secret:
        raise ConfigError(
            "kvbridge needs a shared secret: kv_connector_extra_config.secret or KVBRIDGE_SECRET"
        )
    unknown = set(extra) - {"host", "port", "lease_s", "timeout_s"}
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown keys {sorted(unknown)}")
    try:
        cfg = ConnectorConfig(
            str(kv_transfer_config.engine_id),
            role in ("kv_producer", "kv_both"),
            role in ("kv_consumer", "kv_both"),
            secret.encode(),
            str(extra.get("host", "127.0.0.1")),
            int(extra.get("port", 0)),
            float(extra.get("lease_s", 30.0)),
            float(extra.get("timeout_s", 10.0)),
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"kv_connector_extra_config {extra}: {e}") from None
    if cfg.lease_s <= 0 or cfg.timeout_s <= 0 or not 0 <= cfg.port < 65536:
        raise ConfigError(
            f"kv_connector_extra_config {extra}: lease_s, timeout_s > 0, port in range"
        )
    return cfg
