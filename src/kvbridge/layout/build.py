"""Layouts by name, and ``build_layout``: one rank's :class:`RankLayout` under one of them.

    nhd          per layer  [blocks][K|V][tokens][heads][dim]   (or K, V in separate regions)
    hnd          per layer  [blocks][heads][K|V][tokens][dim]   a head slice is contiguous
    block-major  per group  [blocks][layers][K|V][tokens][heads][dim]
    shared-pool  the k-th layer of every group shares region k, pages of the largest block

State layers use the same orders with rows in place of tokens and slots for blocks.

A layout is a placement function: given, per group, per layer on this rank, the layer's
:class:`Piece` list (one per stream, already in the layout's token order), the block
count per group and ``kv_packed``, it returns the region sizes, one
:class:`~kvbridge.layout.view.View` per (layer, stream) and each group's region pool.
Everything downstream (planner, transports, engines) sees only views, so a new layout is
one function and one :func:`register_layout` call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from itertools import accumulate

from kvbridge.errors import LayoutError
from kvbridge.layout.view import RankLayout, View
from kvbridge.registry import Registry
from kvbridge.spec.model import ModelSpec, Stream
from kvbridge.spec.parallel import Parallel, shard_interval

Groups = list[list[list["Piece"]]]
"""Per group, per layer of this rank, that layer's pieces."""

Built = tuple[list[int], list[View], list[int]]
"""Region sizes, views, and the region pool of each group (see ``RankLayout.pools``)."""

Place = Callable[[Groups, tuple[int, ...], bool], Built]


@dataclass(frozen=True, slots=True)
class Piece:
    """One stream's bytes within one block, before placement: ``rows`` rows of this
    rank's units of each segment, at ``seg_offsets`` with the given strides."""

    layer: int
    stream: str
    nbytes: int
    rows: int
    seg_units: tuple[tuple[int, int], ...]
    seg_offsets: tuple[int, ...]
    row_strides: tuple[int, ...]
    unit_strides: tuple[int, ...]
    unit_bytes: tuple[int, ...]
    interleaved: bool = False


@dataclass(frozen=True, slots=True)
class LayoutKind:
    """``order``: the token order inside a block, ``nhd`` (``[rows][heads][dim]``) or
    ``hnd`` (``[heads][rows][dim]``); ``None``: the caller's ``inner`` order.
    ``split_unpacked``: with ``kv_packed=False`` each stream gets its own region, so a
    layer's streams are not interleaved head by head."""

    name: str
    place: Place
    order: str | None = None
    split_unpacked: bool = False

    def token_order(self, inner: str) -> str:
        order = self.order or inner
        if order not in ("nhd", "hnd"):
            raise LayoutError(f"inner order {inner!r} must be nhd or hnd")
        return order


_LAYOUTS: Registry[LayoutKind] = Registry("layout", LayoutError)


def register_layout(kind: LayoutKind) -> None:
    _LAYOUTS.register(kind.name, kind)


def layout_names() -> tuple[str, ...]:
    return _LAYOUTS.names()


def get_layout(name: str) -> LayoutKind:
    return _LAYOUTS.get(name)


def place(pieces: list[Piece], start: int) -> list[tuple[Piece, int]]:
    """Offset of each piece of one layer's block: consecutive, or shared if interleaved."""
    offsets = accumulate((p.nbytes for p in pieces), initial=start)
    return [(p, start if p.interleaved else off) for p, off in zip(pieces, offsets, strict=False)]


def view_of(p: Piece, region: int, offset: int, block_stride: int, blocks: int) -> View:
    segments = (p.seg_units, p.seg_offsets, p.row_strides, p.unit_strides, p.unit_bytes)
    return View(p.layer, p.stream, region, offset, block_stride, p.rows, blocks, *segments)


def piece(layer: int, s: Stream, rows: int, tp: int, tp_rank: int, order: str) -> Piece:
    units = tuple(shard_interval(g.units, tp, tp_rank, s.replicated) for g in s.segments)
    ubytes = tuple(g.unit_bytes for g in s.segments)
    widths = [(b - a) * ub for (a, b), ub in zip(units, ubytes, strict=True)]
    starts = tuple(accumulate(widths[:-1], initial=0))
    if order == "hnd":  # [segment][units][rows][unit]
        offsets = tuple(rows * x for x in starts)
        row_strides = ubytes
        unit_strides = tuple(rows * ub for ub in ubytes)
    else:  # [rows][segment][units][unit]
        offsets = starts
        row_strides = (sum(widths),) * len(units)
        unit_strides = ubytes
    nbytes = rows * sum(widths)
    return Piece(layer, s.name, nbytes, rows, units, offsets, row_strides, unit_strides, ubytes)


def interleave(pieces: list[Piece]) -> list[Piece]:
    """HND with packed streams: ``[heads][stream][rows][unit]`` so a head slice of all
    streams is one contiguous range per block (streams of one segment, equal units)."""
    segs = {p.seg_units for p in pieces}
    if len(segs) != 1 or len(pieces[0].seg_units) != 1 or len(pieces) == 1:
        return pieces
    sizes = [p.rows * p.unit_bytes[0] for p in pieces]
    return [
        replace(p, seg_offsets=(off,), unit_strides=(sum(sizes),), interleaved=True)
        for p, off in zip(pieces, accumulate(sizes, initial=0), strict=False)
    ]


def _per_layer(groups: Groups, nblk: tuple[int, ...], packed: bool) -> Built:
    if not packed:  # every stream a region of its own
        groups = [[[p] for pieces in layers for p in pieces] for layers in groups]
    regions: list[int] = []
    views: list[View] = []
    for g, layers in enumerate(groups):
        for pieces in layers:
            stride = sum(p.nbytes for p in pieces)
            for p, off in place(pieces, 0):
                views.append(view_of(p, len(regions), off, stride, nblk[g]))
            regions.append(stride * nblk[g])
    return regions, views, list(range(len(groups)))


def _block_major(groups: Groups, nblk: tuple[int, ...], packed: bool) -> Built:
    regions: list[int] = []
    views: list[View] = []
    for g, layers in enumerate(groups):
        stride = sum(p.nbytes for pieces in layers for p in pieces)
        off = 0
        for pieces in layers:
            for p, at in place(pieces, off):
                views.append(view_of(p, len(regions), at, stride, nblk[g]))
            off += sum(p.nbytes for p in pieces)
        regions.append(max(stride, 1) * nblk[g])
    return regions, views, list(range(len(groups)))


def _shared_pool(groups: Groups, nblk: tuple[int, ...], packed: bool) -> Built:
    if len(set(nblk)) != 1:
        raise LayoutError(f"shared-pool needs one block count for all groups, got {nblk}")
    page = max(sum(p.nbytes for p in pieces) for layers in groups for pieces in layers)
    depth = max(len(layers) for layers in groups)
    views: list[View] = []
    for layers in groups:
        for k, pieces in enumerate(layers):
            for p, at in place(pieces, 0):
                views.append(view_of(p, k, at, page, nblk[0]))
    return [page * nblk[0]] * depth, views, [0] * len(groups)


register_layout(LayoutKind("nhd", _per_layer, order="nhd", split_unpacked=True))
register_layout(LayoutKind("hnd", _per_layer, order="hnd", split_unpacked=True))
register_layout(LayoutKind("block-major", _block_major))
register_layout(LayoutKind("shared-pool", _shared_pool))


def build_layout(
    spec: ModelSpec,
    par: Parallel,
    rank: int,
    layout: str,
    num_blocks: int | Mapping[str, int],
    kv_packed: bool = True,
    inner: str = "nhd",
) -> RankLayout:
    """Layout of global ``rank`` of an instance with parallel config ``par``.

    ``num_blocks``: blocks (state: slots) per group, one int for all or by group name.
    ``kv_packed``: per-layer layouts keep a layer's streams in one region, block by block.
    ``inner``: token order inside a block for block-major / shared-pool (``nhd``/``hnd``).
    """
    kind = get_layout(layout)
    spec.check_tp(par.tp)
    stage, tp_rank = par.coords(rank)
    lo, hi = par.stage_ranges(len(spec.layers))[stage]
    order = kind.token_order(inner)
    nblk = tuple(
        num_blocks if isinstance(num_blocks, int) else num_blocks[g.name] for g in spec.groups
    )
    if min(nblk) < 1:
        raise LayoutError(f"num_blocks {nblk} must be ≥ 1 per group")
    per_group: Groups = [[] for _ in spec.groups]
    for lay in spec.layers[lo:hi]:
        if not lay.streams:
            continue
        g = spec.group_of(lay.index)
        rows_tok = spec.groups[g].block_size
        pieces = [
            piece(lay.index, s, s.rows or rows_tok, par.tp, tp_rank, order) for s in lay.streams
        ]
        if order == "hnd" and (kv_packed or not kind.split_unpacked):
            pieces = interleave(pieces)
        per_group[g].append(pieces)
    regions, views, pools = kind.place(per_group, nblk, kv_packed)
    sizes = tuple(g.block_size for g in spec.groups)
    return RankLayout(tuple(regions), tuple(views), sizes, nblk, tuple(pools))
