"""Model configurations of the reference engine and presets that mimic model families.

Every layer is one *mixer* (the token-mixing part) followed by a SwiGLU MLP:

    full     GQA attention over all previous tokens              K, V per token
    sliding  GQA attention over the last `window` tokens          K, V per token
             (the window includes the query token)
    mla      multi-head latent attention                          one latent per token
    gdn      gated delta-rule linear attention, scalar decay      conv + recurrent state
    kda      the same with a per-channel decay (Kimi Delta Attn)  conv + recurrent state
    mamba    Mamba-2 style selective SSM                          conv + SSM state

Head counts are chosen so that TP 1, 2, 3 and 6 work for every preset (TP 4 where all
sharded head counts allow it, e.g. `deepseek`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from refengine.errors import EngineError

MIXERS = ("full", "sliding", "mla", "gdn", "kda", "mamba")
"""The built-in mixer kinds (``refengine/mixers.py`` holds every registered one)."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    pattern: tuple[str, ...]
    """One mixer name per layer."""
    hidden: int = 96
    intermediate: int = 192
    vocab: int = 260
    seed: int = 0
    # attention (full, sliding)
    heads: int = 12
    kv_heads: int = 6
    head_dim: int = 8
    window: int = 8
    # MLA: per-token latent of kv_lora_rank + rope_dim, heads up-projected from it
    kv_lora_rank: int = 24
    rope_dim: int = 4
    nope_dim: int = 8
    v_head_dim: int = 8
    # linear attention (gdn, kda)
    lin_heads: int = 6
    lin_key_dim: int = 8
    lin_value_dim: int = 8
    conv_kernel: int = 4
    # mamba
    ssm_heads: int = 6
    ssm_head_dim: int = 8
    ssm_groups: int = 1
    ssm_state: int = 8

    def __post_init__(self) -> None:
        from refengine.mixers import mixer_names  # the registry imports this module

        known = mixer_names()
        unknown = [m for m in self.pattern if m not in known]
        if unknown or not self.pattern:
            raise EngineError(f"mixers {unknown or 'none'} in {self.pattern}; known: {known}")


PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        ModelConfig("llama", ("full",) * 4, seed=1),
        ModelConfig("gemma", ("sliding", "full", "sliding", "full"), seed=2),
        ModelConfig("deepseek", ("mla",) * 4, seed=11),
        ModelConfig("qwen3-next", ("gdn", "gdn", "full", "gdn", "gdn", "full"), seed=4),
        ModelConfig("kimi-linear", ("kda", "kda", "mla", "kda", "kda", "mla"), seed=5),
        ModelConfig("jamba", ("mamba", "mamba", "full", "mamba"), seed=6),
    )
}


def preset(name: str | ModelConfig, **overrides: Any) -> ModelConfig:
    """A preset by name (or a config as is), with fields overridden (e.g. ``seed=3``)."""
    cfg = name if isinstance(name, ModelConfig) else PRESETS.get(name)
    if cfg is None:
        raise EngineError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return replace(cfg, **overrides) if overrides else cfg
