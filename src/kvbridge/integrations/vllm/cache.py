"""vLLM's KV cache as kvbridge sees it: a :class:`ModelSpec` from the cache groups (the
tensors are described by :mod:`~kvbridge.integrations.vllm.gpu_layout`). Mamba-2 and
Gated DeltaNet layers are state groups of one slot per request
(:mod:`~kvbridge.integrations.vllm.state`); :meth:`VllmCache.tables` picks that slot on
P and on D.

Pipeline parallelism: a PP stage's worker (and the scheduler, whose ``KVCacheConfig`` is
stage 0's) sees only its own layers; the spec is the whole model's all the same
(:mod:`~kvbridge.integrations.vllm.stages`), so that every process of P and D plans with
the same spec. ``layer_names`` and ``kv_specs`` name the process's own layers only."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvbridge.adapter import edge_tables, state_tables
from kvbridge.api import (
    ConfigError,
    Group,
    Kind,
    Layer,
    ModelSpec,
    Parallel,
    Tables,
    attention,
    mla,
    parse_dtype,
)
from kvbridge.integrations.vllm.stages import KINDS, pp_stages, spec_kind, whole_groups, whole_model
from kvbridge.integrations.vllm.state import conv_dim_first, state_layer

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(name: str) -> int:
    """``model.layers.3.self_attn.attn`` → 3."""
    m = _LAYER_INDEX.search(name)
    if m is None:
        raise ConfigError(f"vLLM layer name {name!r} carries no layer index")
    return int(m.group(1))


@dataclass(frozen=True, slots=True)
class VllmCache:
    """What the connector needs of vLLM's configuration, read once."""

    spec: ModelSpec
    par: Parallel
    layer_names: dict[str, int]
    """vLLM attention layer name → kvbridge layer index."""
    num_blocks: int
    """Blocks in vLLM's pool (every group's ids come from it)."""
    state_blocks: dict[int, int] = field(default_factory=dict)
    """Spec group index → vLLM block size (tokens per block) of each Mamba group."""
    state_mode: str = "none"
    """vLLM's ``mamba_cache_mode`` (``"align"`` with prefix caching, ``"none"`` without)."""
    conv_dim_first: bool = False
    """Conv state stored ``[channels, kernel-1]`` (vLLM's ``DS``) rather than ``SD``."""
    kv_specs: dict[str, Any] = field(default_factory=dict)
    """vLLM layer name → its own vLLM spec (a group's ``UniformTypeKVCacheSpecs`` gives
    one per layer): what :mod:`~kvbridge.integrations.vllm.gpu_layout` checks views against."""
    stage: int = 0
    """The PP stage whose layers this process's ``KVCacheConfig`` names."""

    def tables(self, block_ids: Any, n_computed: int, num_blocks: int = 0) -> Tables:
        """vLLM's per-group block ids as :class:`Tables`, checked here against the pool,
        each Mamba group cut to its one state slot (:func:`kvbridge.adapter.state_tables`:
        that request fails alone if a slot is missing, by policy, as vLLM wants for Mamba
        groups). Ids this check refuses go on unsealed: the rank's own check refuses them
        again, so that load alone fails, as any load of bad ids does. ``num_blocks``: the
        pool's blocks if not vLLM's (a park's)."""
        limits = (num_blocks or self.num_blocks,) * len(block_ids)
        tabs = edge_tables(block_ids, limits, "vLLM's block tables")
        return state_tables(tabs, self.state_blocks, self.state_mode, n_computed)


def read_cache(vllm_config: Any, kv_cache_config: Any) -> VllmCache:
    """Spec and parallel config from vLLM's configuration and its KV cache groups (with PP,
    this process's stage's layers: :mod:`~kvbridge.integrations.vllm.stages` makes the
    spec whole)."""
    par_cfg = vllm_config.parallel_config
    _refuse_unplanned(par_cfg, kv_cache_config)
    stages = pp_stages(vllm_config)
    par = Parallel(par_cfg.tensor_parallel_size, par_cfg.pipeline_parallel_size, stages)
    vllm_groups, stage = kv_cache_config.kv_cache_groups, 0
    if stages and len(vllm_groups) > 1:
        stage, vllm_groups = whole_groups(vllm_config, kv_cache_config, stages, layer_index)
    layers, groups, state_blocks = _layers_and_groups(vllm_config, vllm_groups, par.tp)
    own = [(g, n) for g in kv_cache_config.kv_cache_groups for n in g.layer_names]
    names = {n: layer_index(n) for _, n in own}
    kv_specs = {n: _layer_spec(g, n) for g, n in own}
    if stages and len(groups) == 1:
        stage, all_layers, groups = whole_model(layers, groups, stages)
    else:
        n = stages[-1][1] if stages else max(layers) + 1
        all_layers = tuple(layers.get(i, Layer(i, Kind.FULL, ())) for i in range(n))
    spec = ModelSpec(
        vllm_config.model_config.served_model_name or "model", all_layers, tuple(groups)
    )
    spec.check_tp(par.tp)
    mode = str(getattr(vllm_config.cache_config, "mamba_cache_mode", "none"))
    if state_blocks and mode not in ("none", "align"):
        raise ConfigError(f"mamba_cache_mode {mode!r}: the vLLM connector supports none, align")
    return VllmCache(
        spec,
        par,
        names,
        int(kv_cache_config.num_blocks),
        state_blocks,
        mode,
        conv_dim_first(),
        kv_specs,
        stage,
    )


def _layers_and_groups(
    vllm_config: Any, vllm_groups: list[Any], tp: int
) -> tuple[dict[int, Layer], list[Group], dict[int, int]]:
    """kvbridge's layers (by index), groups and Mamba groups' block sizes (by group) of
    vLLM's ``KVCacheGroupSpec`` list."""
    kv_heads = vllm_config.model_config.get_total_num_kv_heads()
    dim_first = conv_dim_first()
    layers: dict[int, Layer] = {}
    groups, state_blocks = [], {}
    for g, group in enumerate(vllm_groups):
        idx = [layer_index(name) for name in group.layer_names]
        for i, name in zip(idx, group.layer_names, strict=True):
            ls = _layer_spec(group, name)
            kind = spec_kind(ls, f"layer {i}")
            if kind is Kind.STATE:
                layers[i] = state_layer(i, ls, tp, dim_first)
            else:
                layers[i] = _layer(i, kind, ls, kv_heads)
        cs = group.kv_cache_spec
        if KINDS.get(type(cs).__name__) is Kind.STATE:  # else attention, or per layer
            state_blocks[g] = cs.block_size
        groups.append(Group(f"g{g}", tuple(idx), 1 if g in state_blocks else cs.block_size))
    return layers, groups, state_blocks


def _layer_spec(group: Any, name: str) -> Any:
    """vLLM's spec of layer ``name`` of ``group`` (a ``UniformTypeKVCacheSpecs`` has one
    per layer)."""
    cs = group.kv_cache_spec
    return (getattr(cs, "kv_cache_specs", None) or {}).get(name, cs)


def _refuse_unplanned(par_cfg: Any, kv_cache_config: Any) -> None:
    """ConfigError for what the connector does not describe: context parallelism (KV
    sharded by token) and, under PP, layers of several KV shapes (vLLM's
    ``UniformTypeKVCacheSpecs`` in a stage's config: the other stages' shapes unknown)."""
    for key in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        if getattr(par_cfg, key, 1) != 1:
            raise ConfigError(f"{key} {getattr(par_cfg, key)}: the vLLM connector supports 1")
    pp = par_cfg.pipeline_parallel_size
    groups = kv_cache_config.kv_cache_groups
    if pp > 1 and any(hasattr(g.kv_cache_spec, "kv_cache_specs") for g in groups):
        raise ConfigError(
            f"pipeline_parallel_size {pp}: the model's layers have several KV shapes; PP "
            "needs one KV shape for every layer of a KV cache group"
        )


def _layer(index: int, kind: Kind, cs: Any, kv_heads: int) -> Layer:
    """An attention or MLA layer of vLLM spec ``cs`` (of ``kind``: :func:`spec_kind`)."""
    dtype = parse_dtype(str(cs.dtype))
    if kind is Kind.MLA:
        # one latent per token (``head_size`` elements: compressed KV | rope key), the
        # same on every TP rank
        return mla(index, cs.head_size, dtype)
    # vLLM's window counts the token being computed: D, which recomputes the last prompt
    # token, needs the ``window - 1`` tokens before it.
    window = cs.sliding_window if kind is Kind.SLIDING else 0
    chunk = cs.attention_chunk_size if kind is Kind.CHUNKED else 0
    return attention(index, kv_heads, cs.head_size, dtype, kind, window, chunk, cs.head_size_v)


CPU_KERNELS = ("vec", "vec16")
"""CPU attention kernels whose cache layout is the one described above."""


def check_cpu_kernel(vllm_config: Any, cache: VllmCache) -> None:
    """Refuse a cache written by a CPU kernel whose layout kvbridge has not verified."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    for gi, g in enumerate(cache.spec.groups):
        if cache.spec.is_state_group(gi):
            continue
        lay = cache.spec.layers[g.layers[0]]
        head = lay.streams[0].segments[0].unit_bytes // lay.streams[0].dtype.itemsize
        isa = _get_attn_isa(
            vllm_config.model_config.dtype, g.block_size, head, vllm_config.cache_config.cache_dtype
        )
        if isa not in CPU_KERNELS:
            raise ConfigError(
                f"group {g.name}: vLLM's CPU attention kernel {isa!r} keeps a cache layout "
                f"kvbridge has not verified (verified: {', '.join(CPU_KERNELS)})"
            )
