"""kvbridge as a vLLM KV connector: ``"kv_connector": "KVBridgeConnector"``,
``"kv_connector_module_path": "kvbridge.integrations.vllm"`` (docs/vllm.md)."""

from kvbridge.integrations.vllm.connector import KVBridgeConnector

__all__ = ["KVBridgeConnector"]
