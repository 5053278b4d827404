"""vLLM's KV caches described in place: on a GPU (or any backend but ``CPU_ATTN``), from
the logical ``[B, H, N, C]`` view of each layer vLLM itself makes (docs/vllm.md, "vLLM's
GPU cache, as described"); strides are read from the tensor, a layout name, when given,
only cross-checks their order. vLLM's CPU attention cache (``cpu_attn``) is K transposed
per block (docs/vllm.md, "vLLM's CPU cache, as measured": K described ``BHDT``, V
``BHTD``), its state tensors as vLLM hands them over. Nothing is copied."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.api import (
    ConfigError,
    Group,
    Kind,
    MemKind,
    ModelSpec,
    RankLayout,
    RegionSet,
    Tables,
    TensorDesc,
    View,
    shard_interval,
    tensor_views,
)
from kvbridge.integrations.vllm.cache import VllmCache
from kvbridge.integrations.vllm.state import state_descs, state_shapes, state_views

KV = ("k", "v")
LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
"""vLLM 0.32's ``KVCacheLayout`` names: the logical axes ``[L, B, H, N, C]`` outermost first."""


@dataclass(frozen=True, slots=True)
class GpuDescs:
    """One layer's cache as kvbridge tensors."""

    descs: tuple[TensorDesc, ...]
    streams: tuple[tuple[str, ...], ...]
    """Per tensor: the kvbridge streams along its S axis (one name: no S axis)."""
    block_size: int
    """Tokens per described block."""
    split: int = 1
    """Described blocks per vLLM block (> 1: kernel blocks, see :func:`kernel_tables`)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """One worker's KV memory as registered: ``bases[i]`` (bytes) holds
    ``layout.regions[i]`` bytes of ``memory`` on GPU ``device`` (0 for host memory)."""

    layout: RankLayout
    bases: list[int]
    spec: ModelSpec
    """The spec as described: each group's block size is the layout's (planning takes it)."""
    splits: tuple[int, ...]
    """Per group: described blocks per vLLM block (see :func:`kernel_tables`)."""
    memory: MemKind = MemKind.HOST
    device: int = 0


def check_order(name: str, shape: Sequence[int], strides: Sequence[int], layout: str) -> None:
    """Raise :class:`ConfigError` unless the axes of ``[B, H, N, C]`` longer than one lie in
    memory in the order ``layout`` names them (``strides`` in elements, decreasing)."""
    want = [a for a in layout.upper() if a != "L"]
    if sorted(want) != sorted("BHNC") or len(layout) != 5:
        raise ConfigError(f"{name}: {layout!r} is not a vLLM KV cache layout ({LAYOUTS})")
    live = [a for a, n in zip("BHNC", shape, strict=True) if n > 1]
    got = sorted(live, key=lambda a: -strides["BHNC".index(a)])
    if got != [a for a in want if a in live]:
        raise ConfigError(
            f"{name}: view {tuple(shape)} of strides {tuple(strides)} keeps its axes in the "
            f"order {''.join(got)}, not vLLM layout {layout}"
        )


def _dims(name: str, t: Any, layout: str | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and strides (elements) of a layer's logical ``[B, H, N, C]`` view."""
    if t.dim() != 4:
        raise ConfigError(f"{name}: vLLM cache view of shape {tuple(t.shape)}; expected [B,H,N,C]")
    shape = tuple(int(x) for x in t.shape)
    strides = tuple(int(s) for s in t.stride())
    if strides[3] != 1:
        raise ConfigError(f"{name}: content axis C of stride {strides[3]}, expected 1")
    if layout is not None:
        check_order(name, shape, strides, layout)
    return shape, strides


def attention_descs(name: str, t: Any, spec: Any, layout: str | None = None) -> GpuDescs:
    """K and V (one tensor with an S axis, or two when their head sizes differ) or the MLA
    latent of one layer, from its ``[B, H, N, C]`` view ``t`` and vLLM ``AttentionSpec``."""
    (nb, heads, rows, content), (sb, sh, sn, _) = _dims(name, t, layout)
    item, addr = int(t.element_size()), int(t.data_ptr())
    hk, hv = int(spec.head_size), int(spec.head_size_v or 0)
    packed = getattr(spec, "state_content_bytes", None) or getattr(spec, "num_head_slots", None)
    if packed or getattr(spec, "tokens_per_state", 1) != 1:
        raise ConfigError(f"{name}: packed or compressed vLLM cache ({type(spec).__name__})")
    if content != hk + hv or heads != int(spec.num_kv_heads):
        raise ConfigError(
            f"{name}: view {tuple(t.shape)} is not [blocks, {spec.num_kv_heads} heads, tokens, "
            f"{hk}+{hv}]"
        )
    if item != getattr(spec.dtype, "itemsize", item):
        raise ConfigError(f"{name}: {t.dtype} view of a {spec.dtype} cache")
    split, rest = divmod(int(spec.block_size), rows)
    if rest or nb % split:
        raise ConfigError(f"{name}: {nb} blocks of {rows} tokens for vLLM blocks of {split * rows}")
    if split > 1 and sb == rows * sn:  # kernel blocks that continue each other's tokens
        nb, sb, rows, split = nb // split, sb * split, rows * split, 1
    if hv == 0:
        latent = TensorDesc(addr, (nb, heads, rows, hk), (sb, sh, sn, 1), item, "BHTD")
        return GpuDescs((latent,), (("latent",),), rows, split)
    if hk == hv:
        kv = TensorDesc(addr, (nb, heads, rows, 2, hk), (sb, sh, sn, hk, 1), item, "BHTSD")
        return GpuDescs((kv,), (KV,), rows, split)
    k = TensorDesc(addr, (nb, heads, rows, hk), (sb, sh, sn, 1), item, "BHTD")
    v = TensorDesc(addr + hk * item, (nb, heads, rows, hv), (sb, sh, sn, 1), item, "BHTD")
    return GpuDescs((k, v), (("k",), ("v",)), rows, split)


def cpu_attn_descs(name: str, t: Any) -> GpuDescs:
    """K ``[blocks, heads, head, block]`` and V ``[blocks, heads, block, head]`` of one
    layer of vLLM's CPU attention cache."""
    if t.dim() != 4:
        raise ConfigError(f"{name}: CPU attention cache of shape {tuple(t.shape)}, expected 4-D")
    nb, heads, bs, two_hd = t.shape
    s0, s1, s2, s3 = t.stride()
    hd = two_hd // 2
    if s3 != 1 or s2 != two_hd or s1 != bs * two_hd:
        raise ConfigError(f"{name}: strides {t.stride()} are not vLLM's CPU cache layout")
    item = t.element_size()
    k = TensorDesc(t.data_ptr(), (nb, heads, hd, bs), (s0, s1, bs, 1), item, "BHDT")
    v_addr = t.data_ptr() + bs * hd * item
    v = TensorDesc(v_addr, (nb, heads, bs, hd), (s0, s1, hd, 1), item, "BHTD")
    return GpuDescs((k, v), (("k",), ("v",)), bs)


def state_gpu_descs(
    name: str, t: Any, spec: Any, dim_first: bool, layout: str | None = None
) -> list[TensorDesc]:
    """Conv and SSM / recurrent state of a ``MambaSpec`` layer from its int8 page view
    ``[B, 1, 1, C]`` (``dim_first``: conv kept ``[channels, kernel-1]``, vLLM's ``DS``)."""
    (_, heads, rows, content), _ = _dims(name, t, layout)
    shapes, dtypes = state_shapes(spec)  # conv and SSM (state_layer checks them further)
    if len(shapes) != 2 or len(dtypes) != 2:
        counts = f"{len(shapes)} state shapes and {len(dtypes)} dtypes"
        raise ConfigError(f"{name}: {counts}; expected 2 of each (conv, ssm)")
    need = sum(
        math.prod(s) * int(getattr(d, "itemsize", 0)) for s, d in zip(shapes, dtypes, strict=True)
    )
    if (heads, rows) != (1, 1) or t.element_size() != 1 or content < need:
        raise ConfigError(
            f"{name}: vLLM state view {tuple(t.shape)} {t.dtype}; expected int8 [B, 1, 1, ≥ {need}]"
        )
    return state_descs(name, t, shapes, dtypes, dim_first)


def gpu_views(
    cache: VllmCache,
    name: str,
    t: Any,
    tp_rank: int,
    regions: RegionSet,
    layout: str | None,
    cpu_attn: bool,
) -> tuple[list[View], tuple[int, int]]:
    """kvbridge views of vLLM layer cache ``t`` of layer ``name`` on ``tp_rank``, checked
    against the spec's layer; and its described blocks ``(tokens, per vLLM block)``."""
    if name not in cache.layer_names or name not in cache.kv_specs:
        raise ConfigError(f"vLLM registered cache {name!r} that no KV cache group names")
    layer, kv_spec = cache.spec.layers[cache.layer_names[name]], cache.kv_specs[name]
    tp = cache.par.tp
    if layer.kind is Kind.STATE:
        if cpu_attn:  # conv and SSM tensors, or a page buffer, as vLLM's CPU worker has them
            descs = state_descs(name, t, *state_shapes(kv_spec), cache.conv_dim_first)
        else:
            descs = state_gpu_descs(name, t, kv_spec, cache.conv_dim_first, layout)
        return state_views(layer, name, descs, tp, tp_rank, regions), (1, 1)
    d = cpu_attn_descs(name, t) if cpu_attn else attention_descs(name, t, kv_spec, layout)
    by_name = {s.name: s for s in layer.streams}
    views: list[View] = []
    for desc, names in zip(d.descs, d.streams, strict=True):
        if any(n not in by_name for n in names):
            raise ConfigError(f"{name}: streams {names}; kvbridge layer has {sorted(by_name)}")
        stream = by_name[names[0]]
        units = shard_interval(stream.segments[0].units, tp, tp_rank, stream.replicated)
        views += tensor_views(layer.index, desc, names, units, regions)
    for v in views:
        want = by_name[v.stream].segments[0].unit_bytes
        if v.unit_bytes[0] != want:
            raise ConfigError(f"{name}: {v.stream} units of {v.unit_bytes[0]} bytes, spec {want}")
    return views, (d.block_size, d.split)


def storage_regions(kv_caches: Mapping[str, Any], kind: MemKind = MemKind.HOST) -> RegionSet:
    """The storages under vLLM's layer views, each registered once, as memory of ``kind``.

    Host memory: CPU tensors only. Device memory: the GPU holding every tensor (its CUDA
    ordinal); CPU tensors stand for GPU 0 (where ``KVBRIDGE_DEVICE_ON_CPU=1`` emulates
    device memory, the unit tests' way through the device paths)."""
    devices = {x.device for t in kv_caches.values() for x in layer_tensors(t)}
    if len(devices) > 1 or any(d.type not in ("cpu", "cuda") for d in devices):
        raise ConfigError(f"vLLM's KV caches lie on {sorted(map(str, devices))}; expected one")
    cuda = any(d.type == "cuda" for d in devices)
    if cuda and kind is MemKind.HOST:
        raise ConfigError(f"{sorted(map(str, devices))} memory registered as host memory")
    regions = RegionSet()
    for t in kv_caches.values():
        for x in layer_tensors(t):
            st = x.untyped_storage()
            regions.add(st.data_ptr(), st.nbytes(), kind, x.get_device() if cuda else 0)
    return regions


def layer_tensors(t: Any) -> list[Any]:
    """A layer's tensors (vLLM gives one, or a list: conv and SSM state)."""
    return list(t) if isinstance(t, (list, tuple)) else [t]


def gpu_rank_layout(
    cache: VllmCache,
    tp_rank: int,
    kv_caches: Mapping[str, Any],
    layout: str | None = None,
    memory: MemKind = MemKind.HOST,
    cpu_attn: bool = False,
) -> Placement:
    """The :class:`RankLayout` of ``kv_caches`` (vLLM layer name → its view, as
    ``register_kv_caches`` gets them, the layers of ``cache``'s stage). Where vLLM keeps
    kernel blocks whose tokens do not continue each other, the group is described in kernel
    blocks: :attr:`Placement.spec` says so, and :func:`kernel_tables` maps block ids. Groups
    of one split share one pool of block ids, as vLLM's groups do. A group none of whose
    layers this PP stage holds is described with vLLM's ``cache.num_blocks`` (0: refused).
    ``cpu_attn``: the caches of vLLM's CPU attention backend (:func:`cpu_attn_descs`)."""
    spec = cache.spec
    regions = storage_regions(kv_caches, memory)
    views: list[View] = []
    blocks: dict[int, tuple[int, int]] = {}
    for name, t in kv_caches.items():
        vs, got = gpu_views(cache, name, t, tp_rank, regions, layout, cpu_attn)
        g = spec.group_of(cache.layer_names[name])
        if blocks.setdefault(g, got) != got:
            raise ConfigError(f"{name}: blocks of {got[0]} ×{got[1]}, group: {blocks[g]}")
        views += vs
    stage = range(*cache.par.stage_ranges(len(spec.layers))[cache.stage])
    groups, splits, counts = _group_blocks(spec, blocks, views, stage, cache.num_blocks)
    pools = tuple(sorted(set(splits)).index(s) for s in splits)
    sizes = tuple(g.block_size for g in groups)
    rank = RankLayout(regions.sizes, tuple(views), sizes, counts, pools)
    described = ModelSpec(spec.name, spec.layers, groups)
    device = regions.regions[0].device if regions.regions else 0
    return Placement(rank, list(regions.bases), described, splits, memory, device)


def _group_blocks(
    spec: ModelSpec,
    blocks: Mapping[int, tuple[int, int]],
    views: Sequence[View],
    stage: range,
    pool: int,
) -> tuple[tuple[Group, ...], tuple[int, ...], tuple[int, ...]]:
    """Per spec group: the group as described, its split, the blocks (slots) held. A group
    none of whose layers lie in this PP ``stage`` is read and served by no view here: it
    is vLLM's ``pool`` of blocks, undivided (its split on the stages holding it is unknown
    here; P's scheduler refuses stages that describe a group in different blocks)."""
    groups, splits, counts = [], [], []
    for g, grp in enumerate(spec.groups):
        if g not in blocks:
            mine = [i for i in grp.layers if i in stage]
            if mine or pool < 1:
                raise ConfigError(
                    f"group {grp.name}: vLLM registered none of its layers (of this PP "
                    f"stage's layers {stage.start}..{stage.stop - 1}, it holds {mine})"
                )
            groups.append(grp)
            splits.append(1)
            counts.append(pool)
            continue
        bs, split = blocks[g]
        if grp.block_size != bs * split:
            raise ConfigError(
                f"group {grp.name}: spec blocks of {grp.block_size} tokens, vLLM's cache "
                f"holds blocks of {bs * split}"
            )
        groups.append(Group(grp.name, grp.layers, bs))
        splits.append(split)
        counts.append(min(v.blocks for v in views if spec.group_of(v.layer) == g))
    return tuple(groups), tuple(splits), tuple(counts)


def kernel_tables(tables: Tables, splits: Sequence[int]) -> Tables:
    """vLLM's per-group block ids as described block ids: id ``b`` of a group split in
    ``s`` kernel blocks becomes ``b·s, …, b·s + s - 1`` (as vLLM's
    ``AttentionGroup.map_to_kernel_block_table``, ``vllm/v1/worker/utils.py``, maps them
    for its kernels), by numpy. Ids checked against ``n`` blocks stay checked, against
    ``n·s``."""
    ids = []
    for tab, s in zip(tables.ids, splits, strict=True):
        if s > 1:
            tab = (tab[:, None] * s + np.arange(s)).ravel()
            tab.flags.writeable = False
        ids.append(tab)
    limits = tuple(n * s for n, s in zip(tables.limits, splits, strict=True))
    return Tables(tuple(ids), limits, tables.seal)


def table_splits(spec: ModelSpec, block_sizes: Sequence[int]) -> tuple[int, ...]:
    """Per group of ``spec`` (vLLM's block sizes, in tokens): described blocks per vLLM
    block, where a rank's layout describes blocks of ``block_sizes`` tokens."""
    if len(block_sizes) != len(spec.groups):
        raise ConfigError(f"{len(block_sizes)} block sizes for {len(spec.groups)} groups")
    splits = []
    for g, bs in zip(spec.groups, block_sizes, strict=True):
        split, rest = divmod(g.block_size, bs) if bs > 0 else (0, 1)
        if rest or split < 1:
            raise ConfigError(
                f"group {g.name}: vLLM blocks of {g.block_size} tokens, described blocks of {bs}"
            )
        splits.append(split)
    return tuple(splits)
