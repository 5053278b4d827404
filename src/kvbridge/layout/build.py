"""Named layouts are stride choices. Builders return a :class:`RankLayout`.

    nhd          per layer  [blocks][K|V][tokens][heads][dim]   (or K, V in separate regions)
    hnd          per layer  [blocks][heads][K|V][tokens][dim]   a head slice is contiguous
    block-major  per group  [blocks][layers][K|V][tokens][heads][dim]
    shared-pool  the k-th layer of every group shares region k, pages of the largest block

State layers use the same orders with rows in place of tokens and slots for blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from kvbridge.errors import LayoutError
from kvbridge.layout.view import RankLayout, View
from kvbridge.spec.model import ModelSpec, Stream
from kvbridge.spec.parallel import Parallel
from kvbridge.spec.sharding import shard_interval

LAYOUTS = ("nhd", "hnd", "block-major", "shared-pool")


@dataclass(frozen=True, slots=True)
class _Piece:
    """One stream's bytes within one block, before placement."""

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


def _place(pieces: list[_Piece], start: int) -> list[tuple[_Piece, int]]:
    """Offset of each piece of one layer's block: consecutive, or shared if interleaved."""
    out, off = [], start
    for p in pieces:
        out.append((p, start if p.interleaved else off))
        off += p.nbytes
    return out


def _piece(layer: int, s: Stream, rows: int, tp: int, tp_rank: int, order: str) -> _Piece:
    units = tuple(shard_interval(g.units, tp, tp_rank, s.replicated) for g in s.segments)
    ubytes = tuple(g.unit_bytes for g in s.segments)
    row_bytes = sum((b - a) * ub for (a, b), ub in zip(units, ubytes, strict=True))
    offs, rstr, ustr, pos = [], [], [], 0
    for (a, b), ub in zip(units, ubytes, strict=True):
        if order == "hnd":  # [segment][units][rows][unit]
            offs.append(pos)
            rstr.append(ub)
            ustr.append(rows * ub)
            pos += rows * (b - a) * ub
        else:  # [rows][segment][units][unit]
            offs.append(pos)
            rstr.append(row_bytes)
            ustr.append(ub)
            pos += (b - a) * ub
    nbytes = rows * row_bytes
    return _Piece(layer, s.name, nbytes, rows, units, tuple(offs), tuple(rstr), tuple(ustr), ubytes)


def _interleave(pieces: list[_Piece]) -> list[_Piece]:
    """HND with packed streams: ``[heads][stream][rows][unit]`` so a head slice of all
    streams is one contiguous range per block (streams of one segment, equal units)."""
    segs = {p.seg_units for p in pieces}
    if len(segs) != 1 or len(pieces[0].seg_units) != 1 or len(pieces) == 1:
        return pieces
    head = sum(p.rows * p.unit_bytes[0] for p in pieces)
    out, off = [], 0
    for p in pieces:
        out.append(replace(p, seg_offsets=(off,), unit_strides=(head,), interleaved=True))
        off += p.rows * p.unit_bytes[0]
    return out


def _view(p: _Piece, region: int, offset: int, block_stride: int, blocks: int) -> View:
    return View(
        p.layer,
        p.stream,
        region,
        offset,
        block_stride,
        p.rows,
        blocks,
        p.seg_units,
        p.seg_offsets,
        p.row_strides,
        p.unit_strides,
        p.unit_bytes,
    )


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
    if layout not in LAYOUTS:
        raise LayoutError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    spec.check_tp(par.tp)
    stage, tp_rank = par.coords(rank)
    lo, hi = par.stage_ranges(len(spec.layers))[stage]
    order = layout if layout in ("nhd", "hnd") else inner
    if order not in ("nhd", "hnd"):
        raise LayoutError(f"inner order {inner!r} must be nhd or hnd")
    nblk = tuple(
        num_blocks if isinstance(num_blocks, int) else num_blocks[g.name] for g in spec.groups
    )
    if min(nblk) < 1:
        raise LayoutError(f"num_blocks {nblk} must be ≥ 1 per group")
    per_group: list[list[list[_Piece]]] = [[] for _ in spec.groups]
    for lay in spec.layers[lo:hi]:
        if not lay.streams:
            continue
        g = spec.group_of(lay.index)
        rows_tok = spec.groups[g].block_size
        pieces = [
            _piece(lay.index, s, s.rows or rows_tok, par.tp, tp_rank, order) for s in lay.streams
        ]
        if order == "hnd" and (kv_packed or layout != "hnd"):
            pieces = _interleave(pieces)
        per_group[g].append(pieces)
    build = {
        "nhd": _per_layer,
        "hnd": _per_layer,
        "block-major": _block_major,
        "shared-pool": _shared_pool,
    }[layout]
    regions, views, pools = build(per_group, nblk, kv_packed)
    sizes = tuple(g.block_size for g in spec.groups)
    return RankLayout(tuple(regions), tuple(views), sizes, nblk, tuple(pools))


Built = tuple[list[int], list[View], list[int]]


def _per_layer(groups: list[list[list[_Piece]]], nblk: tuple[int, ...], packed: bool) -> Built:
    regions: list[int] = []
    views: list[View] = []
    for g, layers in enumerate(groups):
        for pieces in layers:
            if packed:
                stride = sum(p.nbytes for p in pieces)
                for p, off in _place(pieces, 0):
                    views.append(_view(p, len(regions), off, stride, nblk[g]))
                regions.append(stride * nblk[g])
            else:
                for p in pieces:
                    views.append(_view(p, len(regions), 0, p.nbytes, nblk[g]))
                    regions.append(p.nbytes * nblk[g])
    return regions, views, list(range(len(groups)))


def _block_major(groups: list[list[list[_Piece]]], nblk: tuple[int, ...], packed: bool) -> Built:
    regions: list[int] = []
    views: list[View] = []
    for g, layers in enumerate(groups):
        stride = sum(p.nbytes for pieces in layers for p in pieces)
        off = 0
        for pieces in layers:
            for p, at in _place(pieces, off):
                views.append(_view(p, len(regions), at, stride, nblk[g]))
            off += sum(p.nbytes for p in pieces)
        regions.append(max(stride, 1) * nblk[g])
    return regions, views, list(range(len(groups)))


def _shared_pool(groups: list[list[list[_Piece]]], nblk: tuple[int, ...], packed: bool) -> Built:
    if len(set(nblk)) != 1:
        raise LayoutError(f"shared-pool needs one block count for all groups, got {nblk}")
    page = max(sum(p.nbytes for p in pieces) for layers in groups for pieces in layers)
    depth = max(len(layers) for layers in groups)
    views: list[View] = []
    for layers in groups:
        for k, pieces in enumerate(layers):
            for p, at in _place(pieces, 0):
                views.append(_view(p, k, at, page, nblk[0]))
    return [page * nblk[0]] * depth, views, [0] * len(groups)
