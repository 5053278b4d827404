"""The kvbridge :class:`ModelSpec` of a config: exactly what the engine keeps in its cache.

full / sliding   streams k, v       units = KV heads, head_dim float64 each
mla              stream latent      1 replicated unit of kv_lora_rank + rope_dim
gdn / kda        conv_state         kernel-1 rows of q | k | v channels, by head
                 recurrent_state    1 row, units = heads, key_dim·value_dim each
mamba            conv_state         kernel-1 rows of x | B | C channels
                 ssm_state          1 row, units = heads, head_dim·d_state each
"""

from __future__ import annotations

from kvbridge.engine.config import ModelConfig
from kvbridge.spec import (
    DType,
    Kind,
    Layer,
    ModelSpec,
    attention,
    gated_deltanet,
    group_by_kind,
    mamba2,
    mla,
)

F64 = DType.FP64


def model_spec(cfg: ModelConfig, block_size: int = 16) -> ModelSpec:
    """One group per kind present (see :func:`group_by_kind`), ``block_size`` tokens."""
    layers = [_layer(i, mixer, cfg) for i, mixer in enumerate(cfg.pattern)]
    return group_by_kind(cfg.name, layers, block_size)


def _layer(i: int, mixer: str, c: ModelConfig) -> Layer:
    if mixer == "full":
        return attention(i, c.kv_heads, c.head_dim, F64)
    if mixer == "sliding":
        return attention(i, c.kv_heads, c.head_dim, F64, Kind.SLIDING, window=c.window)
    if mixer == "mla":
        return mla(i, c.kv_lora_rank + c.rope_dim, F64)
    if mixer == "mamba":
        return mamba2(
            i, c.ssm_heads, c.ssm_head_dim, c.ssm_groups, c.ssm_state, c.conv_kernel, F64, F64
        )
    h, dk, dv = c.lin_heads, c.lin_key_dim, c.lin_value_dim
    return gated_deltanet(i, h, dk, h, dv, c.conv_kernel, F64, F64)
