"""Model shapes the benchmarks use."""

from __future__ import annotations

from kvbridge.spec import ModelSpec, attention, group_by_kind


def llama(layers: int, kv_heads: int = 8, head_dim: int = 128, block: int = 16) -> ModelSpec:
    """Llama-3.1 shapes: bf16 K/V, ``layers`` full-attention layers."""
    name = {32: "llama-3.1-8b", 80: "llama-3.1-70b"}.get(layers, f"llama-{layers}l")
    return group_by_kind(name, [attention(i, kv_heads, head_dim) for i in range(layers)], block)
