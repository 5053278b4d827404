"""The connector's settings, read once from vLLM's ``kv_transfer_config`` (the keys of
its ``kv_connector_extra_config``: docs/vllm.md), and the ``kvbridge`` logger inside vLLM."""

from __future__ import annotations

import hashlib
import json
import logging
import logging.config
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from kvbridge import envs
from kvbridge.api import ConfigError, Keys, transport_names

log = logging.getLogger(__name__)

LOG_FORMAT = (
    "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(name)s] %(message)s"
)
"""vLLM's line layout (its ``_FORMAT``), with the logger's name where vLLM puts file:line."""

LOG_DATEFMT = "%m-%d %H:%M:%S"
"""vLLM's ``_DATE_FORMAT``."""


class _Formatter(logging.Formatter):
    """:data:`LOG_FORMAT`; the process name is vLLM's (``EngineCore``, ``Worker_TP0``),
    set by vLLM's record factory, or else Python's."""

    def format(self, record: logging.LogRecord) -> str:
        if not hasattr(record, "vllm_process_name"):
            record.vllm_process_name = record.processName
        return super().format(record)


def log_stream() -> IO[str]:
    """The stream vLLM logs to: ``VLLM_LOGGING_STREAM`` (``ext://sys.stdout`` by default,
    or ``ext://sys.stderr``, any ``ext://`` object), resolved now."""
    name = envs.vllm_log_stream()
    if not name.startswith("ext://"):
        raise ConfigError(
            f"VLLM_LOGGING_STREAM={name!r}: expected ext://sys.stdout or ext://sys.stderr"
        )
    try:
        stream: IO[str] = logging.config.BaseConfigurator({}).resolve(name[len("ext://") :])
    except ValueError as e:
        raise ConfigError(f"VLLM_LOGGING_STREAM={name!r}: {e}") from None
    return stream


def setup_logging(stream: IO[str] | None = None) -> None:
    """Give the ``kvbridge`` logger a handler (``stream``, default vLLM's, see
    :func:`log_stream`) in :data:`LOG_FORMAT` at ``KVBRIDGE_LOG_LEVEL`` (default vLLM's
    ``VLLM_LOGGING_LEVEL``, else INFO), not propagated, so its lines are printed once.
    Runs where the connector object is built (engine core, workers). vLLM configures only
    its own logger: without this, kvbridge's records reach Python's last-resort handler
    (WARNING and up, message only). Does nothing if ``VLLM_CONFIGURE_LOGGING=0``, if the
    ``kvbridge`` logger already has a handler (a second connector object) or the root
    logger has one (the process set logging up itself: pytest, ``kvbridge proxy``)."""
    logger = logging.getLogger("kvbridge")
    if not envs.vllm_configures_logging() or logger.handlers or logging.getLogger().handlers:
        return
    name = envs.log_level()
    level = logging.getLevelNamesMapping().get(name)
    if level is None:
        raise ConfigError(
            f"KVBRIDGE_LOG_LEVEL (or VLLM_LOGGING_LEVEL)={name!r}: not a level (DEBUG, INFO, …)"
        )
    handler = logging.StreamHandler(stream if stream is not None else log_stream())
    handler.setFormatter(_Formatter(LOG_FORMAT, datefmt=LOG_DATEFMT))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    engine_id: str
    producer: bool
    consumer: bool
    secret: bytes
    host: str = "127.0.0.1"
    port: int = 0
    lease_s: float = 60.0
    timeout_s: float = 10.0
    model_id: str = ""
    advertise: str = ""
    keys_file: str = ""
    transport: str = "nixl"
    prepare: tuple[tuple[str, str], ...] = ()
    """D: P instances (engine id, side-channel endpoint) connected at start-up
    (:meth:`Consumer.prepare`), so their first request costs what a warm one does."""
    num_threads: int | None = None
    """UCX worker threads of this engine's NIXL agents, the key vLLM's NixlConnector reads
    (None: ``KVBRIDGE_UCX_THREADS``, default 0; :func:`kvbridge.envs.ucx_threads`)."""
    park_blocks: int = 0
    """P: blocks of its own (per worker, in vLLM blocks, one kept empty) into which a
    finished request's KV is copied so vLLM frees it at once and an idle P idles
    (:mod:`~kvbridge.integrations.vllm.park`); 0: none, the request's blocks are held."""
    park_port: int = 0
    """P: the side-channel port of the parked blocks' handshakes and leases (0: any)."""


VOLATILE = ("_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation")
"""Config keys that name where or how a model was loaded, not which model it is."""


def model_fingerprint(hf_config: Any) -> str:
    """A short hash of the model's config (architecture, sizes, every hyper-parameter),
    without the keys that depend on where it was loaded from: P and D may keep the same
    checkpoint under different paths. Two models whose KV caches have the same shapes
    (say a Llama and a Qwen3 of equal sizes) differ here, and D refuses the other's
    bytes. Different weights under one config (fine-tunes) need ``model_id``."""
    body = {k: v for k, v in hf_config.to_dict().items() if not k.startswith(VOLATILE)}
    text = json.dumps(body, sort_keys=True, default=str)
    return "cfg-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def read_config(kv_transfer_config: Any, hf_config: Any = None) -> ConnectorConfig:
    """The settings; ``hf_config`` (vLLM's ``model_config.hf_config``) gives the
    default ``model_id``."""
    role = kv_transfer_config.kv_role
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ConfigError(f"kv_role {role!r}: expected kv_producer, kv_consumer or kv_both")
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    secret = str(extra.pop("secret", "") or os.environ.get("KVBRIDGE_SECRET", ""))
    if not secret:
        raise ConfigError(
            "kvbridge needs a shared secret: kv_connector_extra_config.secret or KVBRIDGE_SECRET"
        )
    unknown = set(extra) - READ.keys()
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown keys {sorted(unknown)}")
    kw: dict[str, Any] = {}
    for key, value in extra.items():
        try:
            if value is not None:  # None: the default
                kw[key] = READ[key](value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"kv_connector_extra_config {key}={value!r}: {e}") from None
    if not kw.get("model_id") and hf_config is not None:
        kw["model_id"] = model_fingerprint(hf_config)
    cfg = ConnectorConfig(
        engine_id=str(kv_transfer_config.engine_id),
        producer=role in ("kv_producer", "kv_both"),
        consumer=role in ("kv_consumer", "kv_both"),
        secret=secret.encode(),
        **kw,
    )
    if cfg.num_threads is not None and not 0 <= cfg.num_threads <= 64:
        raise ConfigError(f"kv_connector_extra_config num_threads={cfg.num_threads}: 0..64")
    _check_park(cfg)
    if cfg.lease_s <= 0 or cfg.timeout_s <= 0 or not 0 <= cfg.port < 65536:
        raise ConfigError(
            f"kv_connector_extra_config {extra}: lease_s, timeout_s > 0, port in range"
        )
    if cfg.transport not in transport_names():
        raise ConfigError(
            f"kv_connector_extra_config transport={cfg.transport!r}; "
            f"known: {', '.join(transport_names())}"
        )
    if cfg.keys_file:  # refuse a bad file at start-up, not at the first request
        check_keys(cfg.keys_file, cfg.engine_id)
    return cfg


def _check_park(cfg: ConnectorConfig) -> None:
    if cfg.park_blocks < 0 or cfg.park_blocks == 1 or not 0 <= cfg.park_port < 65536:
        raise ConfigError(
            f"kv_connector_extra_config park_blocks={cfg.park_blocks} (0, or 2 and more: "
            f"one stays empty), park_port={cfg.park_port}"
        )
    if cfg.park_port and cfg.park_port == cfg.port:
        raise ConfigError(f"kv_connector_extra_config park_port = port = {cfg.port}: two servers")
    if cfg.park_blocks and not cfg.producer:
        log.warning("kvbridge: park_blocks is P's setting: %s parks nothing", cfg.engine_id)


def _whole(value: Any) -> int:
    """A whole number given as one (or its digits), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"a whole number, not {value!r}")
    return int(value)


def _peers(value: Any) -> tuple[tuple[str, str], ...]:
    """``prepare``: ``"engine_id@tcp://host:port"`` items, as a list or one string with
    commas → ((engine id, endpoint), ...)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise ValueError(f"prepare: a list of 'engine_id@tcp://host:port', not {value!r}")
    out: dict[str, str] = {}
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        eid, at, endpoint = item.rpartition("@")
        if not (eid and at and endpoint.startswith("tcp://")):
            raise ValueError(f"prepare: {item!r} is not 'engine_id@tcp://host:port'")
        if eid in out:
            raise ValueError(f"prepare: engine id {eid!r} named twice")
        out[eid] = endpoint
    return tuple(out.items())


def check_keys(path: str, engine_id: str) -> Keys:
    """The keys at ``path``; a new identity for ``engine_id`` if there is no file (first
    start); :class:`ConfigError` if the file's identity is another engine id's."""
    if not os.path.exists(path):
        try:
            keys = Keys.new_identity(path, engine_id)
            log.warning(
                "kvbridge: new identity %s %s in %s", engine_id, keys.server_public.decode(), path
            )
        except ConfigError:
            if not os.path.exists(path):  # not another process of this engine writing it
                raise
    keys = Keys.load(path)
    if keys.engine_id and keys.engine_id != engine_id:
        raise ConfigError(
            f"keys_file {path} is the identity of {keys.engine_id!r}, this engine is "
            f"{engine_id!r} (give kv_transfer_config.engine_id, or another file)"
        )
    return keys


READ: dict[str, Callable[[Any], Any]] = {
    **dict.fromkeys(("host", "model_id", "advertise", "keys_file", "transport"), str),
    **dict.fromkeys(("lease_s", "timeout_s"), float),
    **dict.fromkeys(("num_threads", "park_blocks", "park_port"), _whole),
    "port": int,
    "prepare": _peers,
}
"""``kv_connector_extra_config`` keys besides the secret: each read into the
:class:`ConnectorConfig` field of its name (absent or None: the field's default)."""
