"""The bytes of one layer's streams within one block, before a layout places them.

A layout (``layout/placements.py``, registered in ``layout/registry.py``) receives, per
group, per layer, the layer's :class:`Piece` list, and returns regions and views.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvbridge.layout.view import View
from kvbridge.spec.model import Stream
from kvbridge.spec.sharding import shard_interval

Groups = list[list[list["Piece"]]]
"""Per group, per layer of this rank, that layer's pieces."""

Built = tuple[list[int], list[View], list[int]]
"""Region sizes, views, and the region pool of each group (see ``RankLayout.pools``)."""


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


def place(pieces: list[Piece], start: int) -> list[tuple[Piece, int]]:
    """Offset of each piece of one layer's block: consecutive, or shared if interleaved."""
    out, off = [], start
    for p in pieces:
        out.append((p, start if p.interleaved else off))
        off += p.nbytes
    return out


def piece(layer: int, s: Stream, rows: int, tp: int, tp_rank: int, order: str) -> Piece:
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
    return Piece(layer, s.name, nbytes, rows, units, tuple(offs), tuple(rstr), tuple(ustr), ubytes)


def interleave(pieces: list[Piece]) -> list[Piece]:
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


def view_of(p: Piece, region: int, offset: int, block_stride: int, blocks: int) -> View:
    segments = (p.seg_units, p.seg_offsets, p.row_strides, p.unit_strides, p.unit_bytes)
    return View(p.layer, p.stream, region, offset, block_stride, p.rows, blocks, *segments)
