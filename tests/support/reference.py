"""The element-wise reference: deliberately naive, one unit at a time.

P memories are filled so that every unit of every (layer, stream, token/row) holds
bytes that encode where it came from; the reference then says what every D byte must
hold after a transfer. It shares no code with the planner: it walks tokens and units
in Python and addresses them straight from the views' strides.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from kvbridge.layout.view import RankLayout, View
from kvbridge.spec.model import Kind, Layer, ModelSpec
from kvbridge.spec.parallel import Parallel


def encode(layer: int, stream: int, token: int, unit: int, nbytes: int) -> np.ndarray:
    """Bytes that identify (layer, stream, token, unit); position-dependent within the unit."""
    x = np.uint64((((layer * 131 + stream) * 1_000_003 + token) * 65_537 + unit) % (1 << 61))
    i = np.arange(nbytes, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = (x * np.uint64(0x9E3779B97F4A7C15)) ^ (i * np.uint64(0xBF58476D1CE4E5B9))
        h ^= h >> np.uint64(29)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(32)
    return (h & np.uint64(0xFF)).astype(np.uint8)


def held_units(units: int, tp: int, rank: int, replicated: bool) -> list[int]:
    """The global units TP ``rank`` holds, by the rule of
    :func:`kvbridge.spec.parallel.shard_interval` (written out again, one unit at a time)."""
    if replicated:
        return list(range(units))
    if units >= tp:
        per = units // tp
        return [u for u in range(units) if u // per == rank]
    return [rank // (tp // units)]


def rank_layers(spec: ModelSpec, par: Parallel, rank: int) -> list[int]:
    stage = rank // par.tp
    n = len(spec.layers)
    if par.stages:
        lo, hi = par.stages[stage]
    else:
        sizes = [n // par.pp + (1 if s < n % par.pp else 0) for s in range(par.pp)]
        lo = sum(sizes[:stage])
        hi = lo + sizes[stage]
    return list(range(lo, hi))


def needed(layer: Layer, n: int, cached: int, pad: tuple[int, int] | None = None) -> list[int]:
    """Tokens (state: rows marker [0]) D needs, listed one by one. With ``pad = (bs_P,
    bs_D)``: also every other token of the blocks that hold the first and the last of
    them on both sides (never below ``cached``, never past either side's last block)."""
    if cached >= n:
        return []
    if layer.kind is Kind.STATE:
        return [0]
    toks = list(range(cached, n))
    if layer.kind is Kind.SLIDING:
        toks = [t for t in toks if t >= n - (layer.window - 1)]
    if layer.kind is Kind.CHUNKED:
        toks = [t for t in toks if t >= n - n % layer.chunk]
    if pad and toks:
        first, last = toks[0], toks[-1]
        lo = max([cached] + [first // bs * bs for bs in pad])
        hi = min((last // bs + 1) * bs for bs in pad)
        toks = list(range(lo, hi))
    return toks


def _unit_addr(v: View, block: int, row: int, seg: int, unit: int) -> int:
    local = unit - v.seg_units[seg][0]
    return (
        v.offset
        + block * v.block_stride
        + v.seg_offsets[seg]
        + row * v.row_strides[seg]
        + local * v.unit_strides[seg]
    )


def _visit(
    spec: ModelSpec,
    par: Parallel,
    rank: int,
    layout: RankLayout,
    tokens_of: Callable[[Layer], list[int]],
    tables: list[list[int]],
) -> Iterator[tuple[int, int, np.ndarray]]:
    """Yield (region, byte offset, expected bytes) for every unit a rank holds."""
    tp_rank = rank % par.tp
    for li in rank_layers(spec, par, rank):
        layer = spec.layers[li]
        if not layer.streams:  # a layer that caches nothing is in no group
            continue
        g = spec.group_of(li)
        bs = spec.groups[g].block_size
        for si, s in enumerate(layer.streams):
            v = layout.view(li, s.name)
            for seg_i, seg in enumerate(s.segments):
                for u in held_units(seg.units, par.tp, tp_rank, s.replicated):
                    for t in tokens_of(layer):
                        if layer.kind is Kind.STATE:
                            for row in range(s.rows):
                                addr = _unit_addr(v, tables[g][0], row, seg_i, u)
                                data = encode(li, si, row, u, seg.unit_bytes)
                                yield from _parts(v, seg_i, v.region, addr, data)
                        else:
                            addr = _unit_addr(v, tables[g][t // bs], t % bs, seg_i, u)
                            data = encode(li, si, t, u, seg.unit_bytes)
                            yield from _parts(v, seg_i, v.region, addr, data)


def _parts(
    v: View, seg: int, region: int, addr: int, data: np.ndarray
) -> Iterator[tuple[int, int, np.ndarray]]:
    """A unit's bytes where the view keeps them: whole, or in equal parts a stride apart."""
    n, size, stride = v.piece(seg)
    for i in range(n):
        yield region, addr + i * stride, data[i * size : (i + 1) * size]


def fill_source(
    spec: ModelSpec,
    par: Parallel,
    rank: int,
    layout: RankLayout,
    bufs: list[np.ndarray],
    n: int,
    tables: list[list[int]],
    ends: list[int] | None = None,
) -> None:
    """Write the encoded request of ``n`` tokens into P rank ``rank``'s buffers (group
    ``g``: ``ends[g]`` tokens, when given: the padding slots of a last block too)."""

    def all_tokens(layer: Layer) -> list[int]:
        if layer.kind is Kind.STATE:
            return [0]
        return list(range(ends[spec.group_of(layer.index)] if ends else n))

    for region, addr, data in _visit(spec, par, rank, layout, all_tokens, tables):
        bufs[region][addr : addr + data.shape[0]] = data


def expected_dest(
    spec: ModelSpec,
    par: Parallel,
    rank: int,
    layout: RankLayout,
    before: list[np.ndarray],
    n: int,
    cached: int,
    tables: list[list[int]],
    pads: list[tuple[int, int]] | None = None,
) -> list[np.ndarray]:
    """What D rank ``rank``'s buffers must hold after the transfer (``before`` untouched).
    ``pads[g] = (bs_P, bs_D)``: group ``g``'s range padded to whole blocks."""
    out = [b.copy() for b in before]

    def wanted(layer: Layer) -> list[int]:
        return needed(layer, n, cached, pads[spec.group_of(layer.index)] if pads else None)

    for region, addr, data in _visit(spec, par, rank, layout, wanted, tables):
        out[region][addr : addr + data.shape[0]] = data
    return out
