"""Which description a worker's KV tensors get
(:func:`~kvbridge.integrations.vllm.gpu_layout.gpu_rank_layout`), and which memory they
are registered as, chosen once, in ``register_kv_caches``: vLLM's CPU attention backend
(``CPU_ATTN``, K transposed inside each block; verified CPU kernels only) in host memory;
a KV tensor on a CUDA device, or an attention layer of any other backend (``CPU_MLA`` on
the CPU), over vLLM's logical ``[B, H, N, C]`` views, in device memory on the tensors' GPU
(CPU tensors: device memory where ``KVBRIDGE_DEVICE_ON_CPU=1`` emulates it, host memory
otherwise)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from kvbridge import envs
from kvbridge.api import Kind, MemKind
from kvbridge.integrations.vllm.cache import VllmCache, check_cpu_kernel
from kvbridge.integrations.vllm.gpu_layout import Placement, gpu_rank_layout, layer_tensors

CPU_BACKEND = "CPU_ATTN"
"""The one backend whose cache is not vLLM's logical view (K transposed per block)."""


def place(
    vllm_config: Any, cache: VllmCache, tp_rank: int, kv_caches: Mapping[str, Any]
) -> Placement:
    """Describe the tensors vLLM gives ``register_kv_caches`` on ``tp_rank`` (no copy)."""
    layers = cache.spec.layers
    attention = [n for n, i in cache.layer_names.items() if layers[i].kind is not Kind.STATE]
    cuda = any(x.is_cuda for t in kv_caches.values() for x in layer_tensors(t))
    cpu_attn = not cuda and attention_backends(vllm_config, attention) <= {CPU_BACKEND}
    if cpu_attn:
        check_cpu_kernel(vllm_config, cache)
    emulated = envs.device_on_cpu() and not torch.cuda.is_available() and not cpu_attn
    memory = MemKind.DEVICE if cuda or emulated else MemKind.HOST
    return gpu_rank_layout(cache, tp_rank, kv_caches, layout_name(vllm_config), memory, cpu_attn)


def attention_backends(vllm_config: Any, names: Iterable[str]) -> frozenset[str]:
    """Names of the backends vLLM runs the attention layers ``names`` with (e.g.
    ``CPU_ATTN``, ``FLASH_ATTN``). Where the config holds no layers (a config built without
    a model, as in unit tests): the configured backend, else ``CPU_ATTN`` on vLLM's CPU
    platform, else none."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, list(names))
    if layers:
        return frozenset(layer.get_attn_backend().get_name() for layer in layers.values())
    chosen = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if chosen is not None:
        return frozenset({str(chosen.name)})
    from vllm.platforms import current_platform

    return frozenset({CPU_BACKEND} if current_platform.is_cpu() else ())


def layout_name(vllm_config: Any) -> str | None:
    """vLLM's resolved ``KVCacheLayout`` name (``LBHNC`` …), or None if not resolved yet
    (the strides, read from the tensors, decide; the name only cross-checks them)."""
    try:
        return str(vllm_config.cache_config.get_resolved_kv_cache_layout().name)
    except ValueError:
        return None
