"""Describe memory an engine allocated itself as kvbridge regions and views, no copy.

An engine hands over tensors it already owns: an address, a shape and strides (in
elements), the element size, and what each axis means, as one letter per axis:

    B  block (a paged-cache block, or a state slot)
    S  stream (e.g. 2 for K|V; absent when the tensor holds one stream)
    T  row: token within the block, or state row (absent: one row)
    H  unit: head or group, the shardable axis (absent: one unit, the whole row)
    D  elements of one unit: contiguous (stride 1), or a stride apart (a transposed unit,
       e.g. K kept ``[head_dim][tokens]``: then another axis has stride 1)

Any order of B, S, T, H is allowed and strides are taken as given, so per-layer NHD,
HND, block-major, K-rows-then-V-rows per head (vLLM's CPU cache seen as
``[blocks, heads, 2, block, head]`` = ``"BHSTD"``) and pages shared by several layers are
all just strides. Tensors are located in :class:`RegionSet` regions: the storages the
engine allocated (several tensors may alias one region).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvbridge.errors import LayoutError
from kvbridge.layout.view import View

AXES = frozenset("BSTHD")


class MemKind(enum.StrEnum):
    """Where a region lives: host memory, or the memory of a GPU (``Region.device``
    names which). A transport says which kinds it moves (``Transport.kinds``)."""

    HOST = "host"
    DEVICE = "device"


@dataclass(frozen=True, slots=True)
class TensorDesc:
    """An engine-owned tensor: ``addr`` (bytes), ``shape``/``strides`` (elements), ``axes``."""

    addr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    axes: str

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.strides) or len(self.shape) != len(self.axes):
            raise LayoutError(
                f"tensor shape {self.shape}, strides {self.strides} and axes {self.axes!r} "
                "differ in length"
            )
        if set(self.axes) - AXES or len(set(self.axes)) != len(self.axes):
            raise LayoutError(f"axes {self.axes!r}: each of B S T H D at most once")
        if "B" not in self.axes or "D" not in self.axes:
            raise LayoutError(f"axes {self.axes!r}: need a block axis B and an element axis D")
        if min(self.strides) < 0 or min(self.shape) < 1 or self.itemsize < 1:
            raise LayoutError(f"tensor shape {self.shape} strides {self.strides}: not a cache")

    def size(self, axis: str) -> int:
        return self.shape[self.axes.index(axis)] if axis in self.axes else 1

    def stride_bytes(self, axis: str) -> int:
        return self.strides[self.axes.index(axis)] * self.itemsize if axis in self.axes else 0

    @property
    def nbytes_spanned(self) -> int:
        """Bytes from ``addr`` to one past the last element."""
        last = sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True))
        return (last + 1) * self.itemsize


@dataclass(frozen=True, slots=True)
class Region:
    """``nbytes`` bytes at ``addr`` in memory of ``kind``; ``device``: the GPU's index
    (CUDA ordinal) for device memory, 0 for host memory."""

    addr: int
    nbytes: int
    kind: MemKind = MemKind.HOST
    device: int = 0

    def __post_init__(self) -> None:
        if self.addr < 0 or self.nbytes < 0 or self.device < 0:
            raise LayoutError(f"region {self.addr:#x} +{self.nbytes} B on device {self.device}")
        if not isinstance(self.kind, MemKind):
            raise LayoutError(
                f"region memory kind {self.kind!r}: one of {[k.value for k in MemKind]}"
            )


def regions_at(
    bases: list[int], sizes: tuple[int, ...], kind: MemKind = MemKind.HOST, device: int = 0
) -> list[Region]:
    """A rank's regions: ``sizes[i]`` bytes at ``bases[i]``, all in one memory."""
    return [Region(b, n, kind, device) for b, n in zip(bases, sizes, strict=True)]


@dataclass
class RegionSet:
    """The memory ranges an engine allocated; tensors are located inside them."""

    regions: list[Region] = field(default_factory=list)

    def add(self, addr: int, nbytes: int, kind: MemKind = MemKind.HOST, device: int = 0) -> int:
        """Index of the region ``[addr, addr + nbytes)``; an identical range is added once."""
        for i, r in enumerate(self.regions):
            if (r.addr, r.nbytes, r.kind, r.device) == (addr, nbytes, kind, device):
                return i
            if addr < r.addr + r.nbytes and r.addr < addr + nbytes:
                raise LayoutError(
                    f"region [{addr:#x}, +{nbytes}) overlaps region {i} [{r.addr:#x}, +{r.nbytes})"
                )
        self.regions.append(Region(addr, nbytes, kind, device))
        return len(self.regions) - 1

    def locate(self, addr: int, nbytes: int) -> tuple[int, int]:
        """``(region index, offset)`` of the range ``[addr, addr + nbytes)``."""
        for i, r in enumerate(self.regions):
            if r.addr <= addr and addr + nbytes <= r.addr + r.nbytes:
                return i, addr - r.addr
        raise LayoutError(f"tensor [{addr:#x}, +{nbytes}) lies in no registered region")

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(r.nbytes for r in self.regions)

    @property
    def bases(self) -> tuple[int, ...]:
        return tuple(r.addr for r in self.regions)


def tensor_views(
    layer: int,
    t: TensorDesc,
    streams: tuple[str, ...],
    units: tuple[int, int],
    regions: RegionSet,
) -> list[View]:
    """Views of ``streams`` (one per index of the S axis) of ``layer`` held in ``t``.

    ``units``: the global unit interval (e.g. KV heads) this rank holds, one per index of
    the H axis.
    """
    if t.size("S") != len(streams):
        raise LayoutError(f"layer {layer}: S axis has {t.size('S')} streams, named {streams}")
    if t.size("H") != units[1] - units[0]:
        raise LayoutError(f"layer {layer}: H axis holds {t.size('H')} units, not {units}")
    region, offset = regions.locate(t.addr, t.nbytes_spanned)
    unit_bytes = t.size("D") * t.itemsize
    whole = t.stride_bytes("D") == t.itemsize or t.size("D") == 1
    pieces = () if whole else (t.size("D"),)
    piece_strides = () if whole else (t.stride_bytes("D"),)
    return [
        View(
            layer,
            name,
            region,
            offset + s * t.stride_bytes("S"),
            t.stride_bytes("B"),
            t.size("T"),
            t.size("B"),
            (units,),
            (0,),
            (t.stride_bytes("T"),),
            (t.stride_bytes("H") or unit_bytes,),
            (unit_bytes,),
            pieces,
            piece_strides,
        )
        for s, name in enumerate(streams)
    ]
