"""Parking: P copies a finished request's KV out of vLLM's blocks into blocks of its own,
so vLLM frees the request at once and P's engine can idle while D has not read yet.

Without it, vLLM steps P's engine for as long as a finished request's blocks wait on the
connector (about a core per engine, set by vLLM's loop: docs/vllm.md, "An idle P"). With
``park_blocks`` set, each worker keeps a park: for every region vLLM registered, a copy of
its layout with ``park_blocks`` blocks instead of vLLM's count, registered with NIXL under
a P instance of its own (``<engine id>.park``, :class:`~kvbridge.api.Producer`). The
scheduler side (:class:`ParkBook`) follows which vLLM blocks each request prefilled for
remote decode holds, and in the step that completes its prompt gives it park slots; the
workers copy the blocks there in ``wait_for_save``, after the step's KV writes and before
the request's handle can leave. At ``request_finished`` the handle names the parked
blocks and vLLM frees its own; the slots come back when the park's lease ends. A request
without free slots, or whose blocks at the end are not those copied, is served from
vLLM's blocks as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from kvbridge.api import ConfigError, RankLayout, View
from kvbridge.integrations.vllm.gpu_layout import Placement, layer_tensors

BlockIds = list[list[int]]
"""vLLM block ids, one list per KV cache group."""


@dataclass(frozen=True)
class Slab:
    """A registered region as ``planes × blocks × stride`` bytes: the bytes of block ``b``
    of every view in it lie within ``[b·stride, (b+1)·stride)`` of planes (one; K and V;
    every layer and head slot of vLLM's ``LHBNC``)."""

    region: int
    planes: int
    blocks: int
    """Described blocks (vLLM's blocks × ``split``)."""
    stride: int
    split: int
    groups: tuple[int, ...]


def slabs(layout: RankLayout, group_of: Callable[[int], int], splits: Sequence[int]) -> list[Slab]:
    """Each region of ``layout`` as a :class:`Slab`; :class:`ConfigError` where a region's
    blocks are not whole slabs (a block's bytes interleaved with other blocks')."""
    out = []
    for r, size in enumerate(layout.regions):
        views = [v for v in layout.views if v.region == r]
        shapes = {(v.block_stride, v.blocks) for v in views}
        groups = tuple(sorted({group_of(v.layer) for v in views}))
        split = {splits[g] for g in groups}
        if len(shapes) != 1 or len(split) != 1:
            raise ConfigError(
                f"park: region {r} holds views of block strides and counts {sorted(shapes)}, "
                f"splits {sorted(split)}: parking needs one of each per region"
            )
        ((stride, blocks),) = shapes
        plane, planes = stride * blocks, 0
        for v in views:
            top, span = _reach(v, plane)
            if span > stride:
                raise ConfigError(
                    f"park: view {v.layer}/{v.stream} keeps a block in {span} bytes of a "
                    f"plane, beyond its {stride}-byte block: vLLM's layout interleaves blocks"
                )
            planes = max(planes, top + 1)
        if planes * plane > size:
            raise ConfigError(f"park: region {r} of {size} bytes, {planes} × {plane} described")
        out.append(Slab(r, planes, blocks, stride, split.pop(), groups))
    return out


def _reach(v: View, plane: int) -> tuple[int, int]:
    """``(last plane, bytes within a plane)`` one block of ``v`` reaches: each of its
    offsets and strides is whole planes plus bytes within one."""
    q, r = divmod(v.offset, plane)
    top = span = 0
    for seg in range(len(v.seg_units)):
        a, b = v.seg_units[seg]
        n, part, ps = v.piece(seg)
        steps = (
            (v.seg_offsets[seg], 1),
            (v.row_strides[seg], v.rows - 1),
            (v.unit_strides[seg], b - a - 1),
            (ps, n - 1),
        )
        top = max(top, sum(x // plane * k for x, k in steps))
        span = max(span, sum(x % plane * k for x, k in steps) + part)
    return q + top, r + span


def park_layout(layout: RankLayout, parts: Sequence[Slab], park_blocks: int) -> RankLayout:
    """``layout`` with ``park_blocks`` vLLM blocks per region, each region ``planes ×
    park_blocks·split × stride`` bytes (the park's own memory: every view at the same place
    within a block and plane)."""
    slab = {s.region: s for s in parts}
    views = []
    for v in layout.views:
        s = slab[v.region]
        n = park_blocks * s.split
        plane, to = s.blocks * s.stride, n * s.stride

        def moved(x: int, plane: int = plane, to: int = to) -> int:
            return x // plane * to + x % plane

        views.append(
            replace(
                v,
                offset=moved(v.offset),
                blocks=n,
                seg_offsets=tuple(map(moved, v.seg_offsets)),
                row_strides=tuple(map(moved, v.row_strides)),
                unit_strides=tuple(map(moved, v.unit_strides)),
                piece_strides=tuple(map(moved, v.piece_strides)),
            )
        )
    counts = [0] * len(layout.num_blocks)
    for s in parts:
        for g in s.groups:
            counts[g] = park_blocks * s.split
    regions = tuple(s.planes * park_blocks * s.split * s.stride for s in parts)
    return RankLayout(regions, tuple(views), layout.block_sizes, tuple(counts), layout.pools)


def region_tensors(kv_caches: Mapping[str, Any], bases: Sequence[int]) -> list[torch.Tensor]:
    """The storage at each of ``bases`` (vLLM's KV tensors' storages) as bytes."""
    found: dict[int, torch.Tensor] = {}
    for t in kv_caches.values():
        for x in layer_tensors(t):
            st = x.untyped_storage()
            if st.data_ptr() not in found:
                raw = torch.empty(0, dtype=torch.uint8, device=x.device)
                found[st.data_ptr()] = raw.set_(st, 0, (st.nbytes(),), (1,))
    missing = [b for b in bases if b not in found]
    if missing:
        raise ConfigError(f"park: regions at {missing} are no storage of vLLM's KV tensors")
    return [found[b] for b in bases]


def _described(ids: Sequence[int], split: int) -> np.ndarray:
    """vLLM block ids as described blocks (``b·split … b·split + split - 1``)."""
    a = np.asarray(ids, dtype=np.int64)
    return (a[:, None] * split + np.arange(split)).ravel()


class Park:
    """A worker's park: memory laid out as vLLM's (``layout``, ``bases``) with
    ``park_blocks`` blocks, and the copy into it."""

    def __init__(self, placed: Placement, storages: Sequence[torch.Tensor], park_blocks: int):
        """``storages[i]``: the bytes of ``placed.layout.regions[i]``
        (:func:`region_tensors`)."""
        self.slabs = slabs(placed.layout, placed.spec.group_of, placed.splits)
        self.src = [
            storages[s.region][: s.planes * s.blocks * s.stride].view(s.planes, s.blocks, s.stride)
            for s in self.slabs
        ]
        self.dst = [
            torch.empty(
                (s.planes, park_blocks * s.split, s.stride),
                dtype=torch.uint8,
                device=storages[s.region].device,
            )
            for s in self.slabs
        ]
        self.layout = park_layout(placed.layout, self.slabs, park_blocks)
        self.bases = [d.data_ptr() for d in self.dst]

    def copy(self, src: BlockIds, dst: BlockIds) -> None:
        """Copy vLLM blocks ``src[g][i]`` into park blocks ``dst[g][i]``, every group (on
        the device's current stream: after the step's KV writes queued before)."""
        index: dict[tuple[int, tuple[int, ...]], Index] = {}  # one upload per kind of slab
        for s, a, b in zip(self.slabs, self.src, self.dst, strict=True):
            key = (s.split, s.groups)
            if key not in index:
                index[key] = _index(s, src, dst, a.device)
            got = index[key]
            if got is not None:
                b[:, got[1]] = a[:, got[0]]


Index = tuple[torch.Tensor, torch.Tensor] | None
"""Described block ids to read and to write in a slab, on its device (None: none)."""


def _index(s: Slab, src: BlockIds, dst: BlockIds, on: torch.device) -> Index:
    pairs = [(src[g], dst[g]) for g in s.groups if src[g]]
    if not pairs:
        return None
    si = np.concatenate([_described(x, s.split) for x, _ in pairs])
    di = np.concatenate([_described(y, s.split) for _, y in pairs])
    return torch.as_tensor(si, device=on), torch.as_tensor(di, device=on)
