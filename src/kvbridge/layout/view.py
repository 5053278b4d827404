"""Physical layout of one rank: regions and strided views into them.

    addr(block b, row r, segment s, local unit u) = region_base + offset
        + b·block_stride + seg_offsets[s] + r·row_strides[s] + u·unit_strides[s]

with the unit's ``unit_bytes[s]`` bytes contiguous, or, where ``pieces`` is given, split
into ``pieces[s]`` equal parts ``piece_strides[s]`` bytes apart (a unit laid out
transposed, e.g. K stored ``[head_dim][tokens]`` per head). Rows are tokens for attention
streams and state rows for state streams (whose "block" is a sequence slot).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge.errors import LayoutError


@dataclass(frozen=True, slots=True)
class View:
    layer: int
    stream: str
    region: int
    offset: int
    block_stride: int
    rows: int
    """Rows per block: tokens per block, or state rows per slot."""
    blocks: int
    seg_units: tuple[tuple[int, int], ...]
    """Global unit interval ``[start, stop)`` of each segment held here."""
    seg_offsets: tuple[int, ...]
    row_strides: tuple[int, ...]
    unit_strides: tuple[int, ...]
    unit_bytes: tuple[int, ...]
    pieces: tuple[int, ...] = ()
    """Per segment: parts of a unit (empty: every unit is one contiguous part)."""
    piece_strides: tuple[int, ...] = ()

    def piece(self, seg: int) -> tuple[int, int, int]:
        """``(parts, bytes per part, stride between parts)`` of a unit of segment ``seg``."""
        ub = self.unit_bytes[seg]
        if not self.pieces:
            return (1, ub, ub)
        n = self.pieces[seg]
        if n < 1 or ub % n or len(self.pieces) != len(self.piece_strides):
            raise LayoutError(
                f"view {self.layer}/{self.stream}: {n} pieces of a {ub}-byte unit "
                f"(pieces {self.pieces}, strides {self.piece_strides})"
            )
        return (n, ub // n, self.piece_strides[seg])

    def extent(self) -> tuple[int, int]:
        """``[lo, hi)`` byte range (relative to the region) the view can touch."""
        last = (self.blocks - 1) * self.block_stride
        hi = 0
        for seg, ((a, b), off, rs, st) in enumerate(
            zip(self.seg_units, self.seg_offsets, self.row_strides, self.unit_strides, strict=True)
        ):
            n, part, ps = self.piece(seg)
            hi = max(hi, off + (self.rows - 1) * rs + (b - a - 1) * st + (n - 1) * ps + part)
        strides = (
            self.block_stride,
            *self.row_strides,
            *self.unit_strides,
            *self.seg_offsets,
            *self.piece_strides,
        )
        if min(strides) < 0:
            raise LayoutError(f"view {self.layer}/{self.stream}: negative stride {strides}")
        return (self.offset, self.offset + last + hi)


@dataclass(frozen=True)
class RankLayout:
    """Everything about where one rank keeps its cache; addresses come at bind time."""

    regions: tuple[int, ...]
    """Size in bytes of each region."""
    views: tuple[View, ...]
    block_sizes: tuple[int, ...]
    """Tokens per block, per spec group (1 for state groups)."""
    num_blocks: tuple[int, ...]
    """Blocks (slots) per spec group."""
    pools: tuple[int, ...]
    """Pool id per group: groups sharing a pool share block ids (and regions)."""
    _index: dict[tuple[int, str], View] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index = {}
        for v in self.views:
            if not 0 <= v.region < len(self.regions):
                raise LayoutError(f"view {v.layer}/{v.stream}: no region {v.region}")
            lo, hi = v.extent()
            if lo < 0 or hi > self.regions[v.region]:
                raise LayoutError(
                    f"view {v.layer}/{v.stream} spans bytes [{lo}, {hi}) of region "
                    f"{v.region} which has {self.regions[v.region]} bytes"
                )
            index[(v.layer, v.stream)] = v
        object.__setattr__(self, "_index", index)

    def view(self, layer: int, stream: str) -> View:
        try:
            return self._index[(layer, stream)]
        except KeyError:
            raise LayoutError(f"this rank has no view of layer {layer} stream {stream!r}") from None

    def has(self, layer: int, stream: str) -> bool:
        return (layer, stream) in self._index

    @property
    def nbytes(self) -> int:
        return sum(self.regions)
