"""Run arrays and their coalescing. A run copies ``length`` bytes ``src → dst``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Runs:
    """Runs from one source rank: three int64 arrays of equal length (bytes, addresses)."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return int(self.src.shape[0])

    @property
    def nbytes(self) -> int:
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
