"""Pipeline parallelism: the whole model's layers and KV cache groups from one PP stage's
``KVCacheConfig``, the same in every process of an engine (each worker, the scheduler).

vLLM 0.32 (``get_kv_cache_configs``) groups the layers of *all* workers once and gives
each worker the same groups, in the same order, each group's spec whole but its layer
names cut to the worker's own (a group may name none); the scheduler's config is stage
0's. So a stage knows every group's spec, and nothing of which group the other stages'
layers fall in:

```
whole model (grouped once)   g0 full: 1 3 5 7    g1 sliding: 0 2 4 6
stage 0 (layers 0-3) holds   g0: 1 3             g1: 0 2
stage 1 (layers 4-7) holds   g0: 5 7             g1: 4 6
```

One group (:func:`whole_model`): every layer is like the stage's own. Several
(:func:`whole_groups`): what each model layer caches comes from the model's
``hf_config`` (its layer pattern, read as ``kvbridge.spec`` reads a ``config.json``),
each layer takes the spec of the one group of its kind, and vLLM's own grouping
(``get_kv_cache_groups``) groups the whole model again; cut to the stage's layers, that
must give exactly the groups vLLM gave the stage, or the connector refuses."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from kvbridge.api import ConfigError, Group, Kind, Layer, from_hf_config

KINDS = {
    "FullAttentionSpec": Kind.FULL,
    "MLAAttentionSpec": Kind.MLA,
    "SlidingWindowSpec": Kind.SLIDING,
    "ChunkedLocalAttentionSpec": Kind.CHUNKED,
    "MambaSpec": Kind.STATE,  # Mamba-2, Gated DeltaNet
}
"""The kind of each vLLM spec class the connector describes (a layer's, and under PP a
layer's of another stage)."""


def pp_stages(vllm_config: Any) -> tuple[tuple[int, int], ...]:
    """vLLM's layer partition, ``[start, stop)`` per PP stage (``get_pp_indices``, which
    honours ``VLLM_PP_LAYER_PARTITION``); empty without PP."""
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp == 1:
        return ()
    from vllm.distributed.utils import get_pp_indices

    n = vllm_config.model_config.get_total_num_hidden_layers()
    try:
        return tuple(get_pp_indices(n, s, pp) for s in range(pp))
    except ValueError as e:
        raise ConfigError(f"pipeline_parallel_size {pp} over {n} layers: {e}") from None


def whole_model(
    held: Mapping[int, Layer], groups: list[Group], stages: tuple[tuple[int, int], ...]
) -> tuple[int, tuple[Layer, ...], list[Group]]:
    """With PP and one KV cache group: ``(stage, layers, groups)`` of the whole model from
    one stage's ``held`` layers. They must be exactly one stage's range of ``stages``, all
    of one kind: every layer of the model is then that kind."""
    pp = len(stages)
    assert len(groups) == 1, "several groups: whole_groups"
    idx = sorted(held)
    stage = _own_stage(idx, stages, lambda i: True)
    first = held[idx[0]]
    if first.kind is Kind.STATE:
        raise ConfigError(
            f"pipeline_parallel_size {pp}: a model of state layers (Mamba) only is not planned"
        )
    for i in idx:
        if held[i] != replace(first, index=i):
            raise ConfigError(
                f"pipeline_parallel_size {pp}: layer {i} ({held[i].kind.value}, "
                f"{held[i].token_bytes} B/token) and layer {idx[0]} ({first.kind.value}, "
                f"{first.token_bytes} B/token) differ: PP needs one KV shape for every layer"
            )
    n = stages[-1][1]
    layers = tuple(replace(first, index=i) for i in range(n))
    return stage, layers, [Group(groups[0].name, tuple(range(n)), groups[0].block_size)]


def whole_groups(
    vllm_config: Any, kv_cache_config: Any, stages: tuple[tuple[int, int], ...], index: Any
) -> tuple[int, list[Any]]:
    """With PP and several KV cache groups: ``(stage, groups)``, vLLM's KV cache groups
    (``KVCacheGroupSpec``) of the whole model, in vLLM's order; a layer of another stage
    is named ``model.layers.<i>.pp`` and has its group's spec. ``index`` maps a vLLM layer
    name to its layer index. Raises :class:`ConfigError` where the model's layer pattern,
    the groups' specs and the stage's own layers disagree."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    held = kv_cache_config.kv_cache_groups
    own = {index(n): (n, g.kv_cache_spec) for g in held for n in g.layer_names}
    kinds = model_kinds(vllm_config, stages[-1][1])
    stage = _own_stage(sorted(own), stages, lambda i: kinds[i] is not None)
    by_kind = _spec_of_kind(held)
    merged: dict[str, Any] = {}
    for i, kind in enumerate(kinds):
        if i in own:
            name, spec = own[i]
            if spec_kind(spec, name) is not kind:
                raise ConfigError(
                    f"layer {i}: vLLM caches it as {spec_kind(spec, name)}, the model's "
                    f"config makes it {kind}"
                )
        elif kind in by_kind:
            name, spec = f"model.layers.{i}.pp", by_kind[kind]
        elif kind is not None:
            raise ConfigError(
                f"the model's config makes layer {i} a {kind} layer, but vLLM's KV cache "
                f"groups have kinds {', '.join(map(str, by_kind))}"
            )
        else:
            continue
        merged[name] = spec
    groups = get_kv_cache_groups(vllm_config, merged)
    _check_projection(groups, held, {n for n, _ in own.values()})
    return stage, groups


def model_kinds(vllm_config: Any, n: int) -> list[Kind | None]:
    """What each of the model's ``n`` layers caches (``None``: nothing), from its
    ``hf_config``'s layer pattern."""
    hf = getattr(vllm_config.model_config, "hf_config", None)
    if hf is None:
        raise ConfigError(
            "PP with several KV cache groups: the model has no hf_config to tell which "
            "layers of the other stages are of which kind"
        )
    info = from_hf_config(hf.to_dict())
    kinds: list[Kind | None] = [None] * info.num_model_layers
    for layer, i in zip(info.spec.layers, info.model_layers, strict=True):
        if layer.streams and kinds[i] is not None:
            raise ConfigError(
                f"PP with several KV cache groups: model layer {i} holds two caches "
                f"({kinds[i]}, {layer.kind}), which vLLM's layer names cannot tell apart"
            )
        kinds[i] = layer.kind if layer.streams else kinds[i]
    if len(kinds) != n:
        raise ConfigError(
            f"the model's config ({info.source}) describes {len(kinds)} layers; vLLM has {n}"
        )
    return kinds


def spec_kind(spec: Any, where: str) -> Kind:
    """The kind of a vLLM layer spec (several KV shapes in one group: refused)."""
    kind = KINDS.get(type(spec).__name__)
    if kind is None:
        raise ConfigError(
            f"{where}: vLLM cache kind {type(spec).__name__} is not supported (supported: "
            f"{', '.join(KINDS)})"
        )
    return kind


def _own_stage(
    idx: list[int], stages: tuple[tuple[int, int], ...], caching: Callable[[int], bool]
) -> int:
    """The stage whose ``caching`` layers are exactly ``idx`` (sorted)."""
    for s, (a, b) in enumerate(stages):
        if idx == [i for i in range(a, b) if caching(i)]:
            return s
    raise ConfigError(_no_stage(idx, stages, caching))


def _spec_of_kind(held: list[Any]) -> dict[Kind, Any]:
    """The one vLLM spec of each kind among the groups (two of a kind: unknown which a
    layer of another stage has)."""
    out: dict[Kind, Any] = {}
    for g, group in enumerate(held):
        spec = group.kv_cache_spec
        kind = spec_kind(spec, f"KV cache group {g}")
        if out.setdefault(kind, spec) != spec:
            raise ConfigError(
                f"PP with several KV cache groups: groups of kind {kind} have different "
                f"specs ({out[kind]} and {spec}); a layer of another stage could be either"
            )
    return out


def _check_projection(groups: list[Any], held: list[Any], own: set[str]) -> None:
    """vLLM's groups of the whole model, cut to ``own`` layers, must be ``held``."""
    if len(groups) != len(held):
        raise ConfigError(
            f"the whole model regrouped has {len(groups)} KV cache groups; vLLM gave this "
            f"stage {len(held)}"
        )
    for g, (whole, mine) in enumerate(zip(groups, held, strict=True)):
        cut = [n for n in whole.layer_names if n in own]
        if cut != list(mine.layer_names) or whole.kv_cache_spec != mine.kv_cache_spec:
            raise ConfigError(
                f"KV cache group {g}: the whole model regrouped gives this stage {cut} "
                f"({type(whole.kv_cache_spec).__name__}); vLLM gave it "
                f"{list(mine.layer_names)} ({type(mine.kv_cache_spec).__name__})"
            )


def _no_stage(
    idx: list[int], stages: tuple[tuple[int, int], ...], caching: Callable[[int], bool]
) -> str:
    """Why a PP stage's KV layers ``idx`` (sorted) are no stage's ``caching`` layers of
    ``stages``: what they are beside the stage they overlap most, and the likely cause."""
    got = f"{_ranges(idx)} ({len(idx)} layers)" if idx else "none"
    out = f"this PP stage holds KV layers {got}, which are no stage's layers of vLLM's "
    out += f"partition {list(stages)}"
    s, (a, b) = max(enumerate(stages), key=lambda e: sum(e[1][0] <= i < e[1][1] for i in idx))
    n, held = stages[-1][1], set(idx)
    past = [i for i in idx if i >= n]
    other = [i for i in idx if i < n and not a <= i < b]
    lacks = [i for i in range(a, b) if i not in held and caching(i)]
    if past:
        out += (
            f"; layers {_ranges(past)} lie past the model's {n} layers: likely MTP or "
            "draft layers (speculative decoding), whose KV is not planned under PP"
        )
    if other:
        out += (
            f"; layers {_ranges(other)} are other stages' than stage {s}'s {a}..{b - 1}: "
            "likely a layer partition that differs between processes "
            "(VLLM_PP_LAYER_PARTITION)"
        )
    if lacks:
        out += (
            f"; stage {s}'s layers {_ranges(lacks)} keep no KV cache: likely layers "
            "without attention, or sharing another layer's KV cache, which PP cannot "
            "plan (it needs every layer to keep one KV shape)"
        )
    return out


def _ranges(idx: list[int]) -> str:
    """Sorted layer indices as ranges: ``[0, 1, 2, 5]`` → ``0..2, 5``."""
    cuts = [k for k in range(1, len(idx)) if idx[k] != idx[k - 1] + 1]
    parts = zip([0, *cuts], [*cuts, len(idx)], strict=True)
    return ", ".join(f"{idx[i]}..{idx[j - 1]}" if j - i > 1 else f"{idx[i]}" for i, j in parts)
