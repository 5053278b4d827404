"""Run arrays and their coalescing. A run copies ``length`` bytes ``src → dst``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Grid:
    """``T × B`` runs of one tile pattern over ``B`` tiles, one block per side and tile
    and one block stride per side, not expanded: run ``(t, b)`` copies ``length[t]``
    bytes from ``soff[t] + pid[b] · sstride`` to ``doff[t] + did[b] · dstride``, in the
    order ``t`` major (as :class:`Runs` lists them). A copy kernel can take it as is:
    ``T + B`` entries where the runs take ``T · B``."""

    soff: np.ndarray
    doff: np.ndarray
    length: np.ndarray
    sstride: int
    dstride: int
    pid: np.ndarray
    did: np.ndarray

    def __len__(self) -> int:
        return int(self.soff.shape[0] * self.pid.shape[0])


class Runs:
    """Runs from one source rank: three int64 arrays of equal length (bytes, addresses).
    Made from grids (:meth:`of`: one per job, in order), the arrays are expanded on
    first use, and :attr:`grids` keeps them for the movers that take them whole."""

    __slots__ = ("_dst", "_length", "_src", "grids")

    def __init__(self, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> None:
        self._src: np.ndarray | None = src
        self._dst: np.ndarray | None = dst
        self._length: np.ndarray | None = length
        self.grids: tuple[Grid, ...] | None = None

    @classmethod
    def of(cls, *grids: Grid) -> Runs:
        if not grids:
            raise ValueError("Runs.of needs at least one grid")
        out = cls.__new__(cls)
        out._src = out._dst = out._length = None
        out.grids = grids
        return out

    def _expand(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        assert self.grids is not None
        parts = [
            (
                (g.soff[:, None] + g.pid * g.sstride).ravel(),
                (g.doff[:, None] + g.did * g.dstride).ravel(),
                np.repeat(g.length, g.pid.shape[0]),
            )
            for g in self.grids
        ]
        if len(parts) == 1:
            src, dst, length = parts[0]
        else:
            src, dst, length = (np.concatenate(a) for a in zip(*parts, strict=True))
        self._src, self._dst, self._length = src, dst, length
        return src, dst, length

    @property
    def src(self) -> np.ndarray:
        return self._src if self._src is not None else self._expand()[0]

    @property
    def dst(self) -> np.ndarray:
        return self._dst if self._dst is not None else self._expand()[1]

    @property
    def length(self) -> np.ndarray:
        return self._length if self._length is not None else self._expand()[2]

    def __len__(self) -> int:
        if self._src is None and self.grids is not None:
            return sum(len(g) for g in self.grids)
        return int(self.src.shape[0])

    def __repr__(self) -> str:
        how = f"{len(self.grids)} grids" if self.grids is not None else "arrays"
        return f"Runs({len(self)} runs in {how}, {self.nbytes} B)"

    @property
    def nbytes(self) -> int:
        if self._length is None and self.grids is not None:
            return sum(int(g.length.sum()) * int(g.pid.shape[0]) for g in self.grids)
        return int(self.length.sum())

    def as_uint64(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (self.src.view(np.uint64), self.dst.view(np.uint64), self.length.view(np.uint64))


def merge_adjacent(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> Runs:
    """Merge each run into its predecessor when both sides continue it exactly (order
    kept: only neighbours in the given order merge)."""
    n = src.shape[0]
    if n <= 1:
        return Runs(src, dst, length)
    end_s = src[:-1] + length[:-1]
    cont = (end_s == src[1:]) & ((dst[:-1] + length[:-1]) == dst[1:])
    if not cont.any():
        return Runs(src, dst, length)
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return Runs(src[starts], dst[starts], np.add.reduceat(length, starts))
