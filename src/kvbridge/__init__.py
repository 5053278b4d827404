"""kvbridge: move a request's KV cache from a prefill to a decode instance.

The public API is :mod:`kvbridge.api`; its names are also reachable here
(``kvbridge.Consumer``), imported on first use so that ``import kvbridge`` stays cheap."""

import importlib
from typing import Any

__version__ = "0.1.0"

_API = frozenset(
    {
        "Bound",
        "ConfigError",
        "Consumer",
        "DType",
        "Geometry",
        "Group",
        "IdentityError",
        "IncompatibleError",
        "KVBridgeError",
        "Keys",
        "Kind",
        "Layer",
        "LayoutError",
        "LeaseExpired",
        "LoadState",
        "MemKind",
        "Mode",
        "ModelInfo",
        "ModelSpec",
        "Outcome",
        "Parallel",
        "PeerError",
        "Plan",
        "PlanError",
        "Policy",
        "Producer",
        "ProducerWorker",
        "PromptMismatch",
        "RankInfo",
        "RankLayout",
        "Region",
        "RegionSet",
        "Segment",
        "Side",
        "SideConfig",
        "SpecError",
        "Stream",
        "Tables",
        "TensorDesc",
        "TopologyError",
        "TransferFailed",
        "TransferHandle",
        "TransferTimeout",
        "Transport",
        "TransportError",
        "View",
        "XferHandle",
        "XferState",
        "attention",
        "build_layout",
        "byte_tensor",
        "checked_tables",
        "from_hf_config",
        "gated_deltanet",
        "group_by_kind",
        "kimi_delta",
        "layout_names",
        "load_model",
        "make_transport",
        "mamba1",
        "mamba2",
        "mla",
        "parse_dtype",
        "read_runs",
        "register_layout",
        "register_transport",
        "rows_copy",
        "shard_interval",
        "state_tensor",
        "tensor_views",
        "transport_names",
    }
)
"""The names of :mod:`kvbridge.api` (its ``__all__``); listed here so that a submodule
import such as ``from kvbridge import catalog`` never loads the API."""


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module("kvbridge.api"), name)
    raise AttributeError(f"module 'kvbridge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
