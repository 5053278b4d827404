"""kvbridge as a vLLM KV connector.

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"secret": "..."}}'

P: send a request with ``kv_transfer_params={"do_remote_decode": true}``; its output's
``kv_transfer_params`` go to D unchanged with the full prompt. See docs/vllm.md.
"""

from kvbridge.integrations.vllm.connector import KVBridgeConnector

__all__ = ["KVBridgeConnector"]
