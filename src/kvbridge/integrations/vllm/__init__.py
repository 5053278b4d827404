"""kvbridge as a vLLM KV connector: ``"kv_connector": "KVBridgeConnector"``,
``"kv_connector_module_path": "kvbridge.integrations.vllm"`` (docs/vllm.md).

The connector (and with it vLLM) is imported on first use of the name (vLLM's factory
takes it with ``getattr``), so that the modules which do not need vLLM (``cache``,
``gpu_layout``, ``placement``, ``state``) import without it: gpu-check's vLLM-caches phase
drives them on a GPU machine where vLLM is not installed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbridge.integrations.vllm.connector import KVBridgeConnector

__all__ = ["KVBridgeConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVBridgeConnector":
        from kvbridge.integrations.vllm.connector import KVBridgeConnector

        return KVBridgeConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
