"""The kvbridge :class:`ModelSpec` of a config: exactly what the engine keeps in its cache.

full / sliding   streams k, v       units = KV heads, head_dim float64 each
mla              stream latent      1 replicated unit of kv_lora_rank + rope_dim
gdn / kda        conv_state         kernel-1 rows of q | k | v channels, by head
                 recurrent_state    1 row, units = heads, key_dim·value_dim each
mamba            conv_state         kernel-1 rows of x | B | C channels
                 ssm_state          1 row, units = heads, head_dim·d_state each
"""

from __future__ import annotations

from kvbridge.api import (
    ModelSpec,
    group_by_kind,
)
from refengine.config import ModelConfig
from refengine.mixers import get_mixer


def model_spec(cfg: ModelConfig, block_size: int = 16) -> ModelSpec:
    """One group per kind present (see :func:`group_by_kind`), ``block_size`` tokens;
    each layer's streams as its mixer kind declares them (``refengine/mixers.py``)."""
    layers = [get_mixer(mixer).cache(i, cfg) for i, mixer in enumerate(cfg.pattern)]
    return group_by_kind(cfg.name, layers, block_size)
