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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from kvbridge.api import (
    ConfigError,
    RankLayout,
    Region,
    TransportError,
    View,
    byte_tensor,
    rows_copy,
)
from kvbridge.integrations.vllm.gpu_layout import Placement

Ids = Sequence[Sequence[int] | np.ndarray]
"""Block ids per KV cache group, as lists or arrays."""


class Order(NamedTuple):
    """One request's copy into the park: each of vLLM's ``blocks`` to its park slot in
    ``slots``, per group (a block without a slot is null)."""

    request_id: str
    blocks: Ids
    slots: Ids


@dataclass(frozen=True)
class Slab:
    """A registered region as ``planes × blocks × stride`` bytes, in vLLM's blocks: the
    bytes of vLLM block ``b`` of every view in it (its kernel blocks, where a backend
    splits it) lie within ``[b·stride, (b+1)·stride)`` of planes (one; K and V; every
    layer and head slot of vLLM's ``LHBNC``)."""

    region: int
    planes: int
    blocks: int
    stride: int
    groups: tuple[int, ...]


def slabs(layout: RankLayout, group_of: Callable[[int], int], splits: Sequence[int]) -> list[Slab]:
    """Each region of ``layout`` as a :class:`Slab` (``splits``: described blocks per vLLM
    block, per group); :class:`ConfigError` where a region's blocks are not whole slabs (a
    block's bytes interleaved with other blocks')."""
    out = []
    for r, size in enumerate(layout.regions):
        views = [v for v in layout.views if v.region == r]
        split = [splits[group_of(v.layer)] for v in views]
        shapes = {(v.block_stride * k, v.blocks // k) for v, k in zip(views, split, strict=True)}
        if any(v.blocks % k for v, k in zip(views, split, strict=True)):
            raise ConfigError(f"park: region {r}: kernel blocks not whole vLLM blocks")
        if len(shapes) != 1:
            raise ConfigError(
                f"park: region {r} holds views of vLLM block strides and counts "
                f"{sorted(shapes)}: parking needs one of each per region"
            )
        ((stride, blocks),) = shapes
        plane, planes = stride * blocks, 0
        for v in views:
            top, span = _reach(v, plane)
            span += (splits[group_of(v.layer)] - 1) * v.block_stride  # its kernel blocks
            if span > stride:
                raise ConfigError(
                    f"park: view {v.layer}/{v.stream} keeps a block in {span} bytes of a "
                    f"plane, beyond its {stride}-byte block: vLLM's layout interleaves blocks"
                )
            planes = max(planes, top + 1)
        if planes * plane > size:
            raise ConfigError(f"park: region {r} of {size} bytes, {planes} × {plane} described")
        groups = tuple(sorted({group_of(v.layer) for v in views}))
        out.append(Slab(r, planes, blocks, stride, groups))
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


def park_layout(
    layout: RankLayout, parts: Sequence[Slab], splits: Sequence[int], park_blocks: int
) -> RankLayout:
    """``layout`` with ``park_blocks`` vLLM blocks per region, each region ``planes ×
    park_blocks × stride`` bytes (the park's own memory: every view at the same place
    within a block and plane); every group ``park_blocks`` vLLM blocks (a group this rank
    holds no layer of too, as its layout counts vLLM's pool)."""
    slab = {s.region: s for s in parts}
    views = []
    for v in layout.views:
        s = slab[v.region]
        plane, to = s.blocks * s.stride, park_blocks * s.stride

        def moved(x: int, plane: int = plane, to: int = to) -> int:
            return x // plane * to + x % plane

        views.append(
            replace(
                v,
                offset=moved(v.offset),
                blocks=v.blocks // s.blocks * park_blocks,
                seg_offsets=tuple(map(moved, v.seg_offsets)),
                row_strides=tuple(map(moved, v.row_strides)),
                unit_strides=tuple(map(moved, v.unit_strides)),
                piece_strides=tuple(map(moved, v.piece_strides)),
            )
        )
    counts = tuple(park_blocks * x for x in splits)
    regions = tuple(s.planes * park_blocks * s.stride for s in parts)
    return RankLayout(regions, tuple(views), layout.block_sizes, counts, layout.pools)


class Park:
    """A worker's park: memory laid out as vLLM's (``placed``) with ``park_blocks``
    blocks, and the copy into it."""

    def __init__(self, placed: Placement, park_blocks: int):
        self.slabs = slabs(placed.layout, placed.spec.group_of, placed.splits)
        self.layout = park_layout(placed.layout, self.slabs, placed.splits, park_blocks)
        self.park_blocks = park_blocks
        mem = placed.memory, placed.device
        self.src = [
            byte_tensor(Region(b, n, *mem))
            for b, n in zip(placed.bases, placed.layout.regions, strict=True)
        ]
        self.dst = [
            torch.empty(n, dtype=torch.uint8, device=a.device)
            for n, a in zip(self.layout.regions, self.src, strict=True)
        ]
        self.bases = [d.data_ptr() for d in self.dst]

    def copy(self, orders: Sequence[Order]) -> None:
        """Copy each order's vLLM blocks ``blocks[g][i]`` into park blocks ``slots[g][i]`` (a
        step's ``StepMeta.parks``), every group (null entries skipped), on the device's
        current stream (after the step's KV writes queued before): a block's bytes in each
        plane of its slab are one run of :func:`~kvbridge.api.rows_copy`. A block or slot
        id out of range (its bytes may still lie in the region, another plane's block):
        TransportError before any byte moves."""
        runs = []
        for s in self.slabs:
            blocks, slots = (
                np.concatenate([np.asarray(ids[g], np.int64) for ids in per for g in s.groups])
                for per in ([o.blocks for o in orders], [o.slots for o in orders])
            )
            live = blocks != 0  # null entries: nothing to copy
            blocks, slots = blocks[live], slots[live]
            _in_range("vLLM block", blocks, s.blocks)
            _in_range("park slot", slots, self.park_blocks)
            plane = np.arange(s.planes, dtype=np.int64)[:, None] * s.stride
            d_off = (plane * self.park_blocks + slots * s.stride).ravel()
            runs.append((d_off, (plane * s.blocks + blocks * s.stride).ravel(), s.stride))
        for a, b, (d_off, s_off, size) in zip(self.src, self.dst, runs, strict=True):
            rows_copy(b, d_off, a, s_off, size)


def _in_range(what: str, ids: np.ndarray, count: int) -> None:
    """TransportError unless every id lies in ``[0, count)``."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= count):
        raise TransportError(
            f"park: {what} ids {int(ids.min())}..{int(ids.max())} outside 0..{count - 1}"
        )
