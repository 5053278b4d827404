"""A rank's regions as one ``uint8`` tensor (:class:`Span`: what the kernel mover copies
between) and :class:`LocalMemory`, the staged rounds' scatter and gather into them by
absolute address, where the memory is (numpy on the host, torch kernels on a device).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvbridge.connector.movers.copies import by_length, copy_equal
from kvbridge.connector.movers.device_copies import rows_copy
from kvbridge.errors import TransportError
from kvbridge.layout.tensor import MemKind, Region
from kvbridge.transport.memory import byte_tensor

__all__ = ["LocalMemory", "Span", "equal_runs"]

STRIDE = 64
"""Runs per region guess in :meth:`Span._region_of`."""
MAX_RUN = 1 << 40
"""Runs :meth:`Span.offsets` takes are shorter than this many bytes, and not empty: a
length from the wire outside ``(0, MAX_RUN)`` (a wrapped uint64 among them) is refused
before it is added to an address."""
MIN_PIECE, MAX_PIECES = 256, 8
""":func:`equal_runs` cuts runs into pieces of at least this many bytes, at most this
many per run on average (else it groups them by length)."""


class Span:
    """One ``uint8`` tensor spanning ``regions`` (in this process), addressed by the names
    the plan uses for them: ``names[i]`` stands for ``regions[i].addr`` (P's address of a
    region mapped here; D's own address by default)."""

    def __init__(self, regions: list[Region], names: list[int] | None = None):
        if not regions:
            raise TransportError("a span needs at least one region")
        names = [r.addr for r in regions] if names is None else names
        order = np.argsort(np.array(names, dtype=np.int64), kind="stable")
        addrs = np.array([regions[i].addr for i in order], dtype=np.int64)
        sizes = np.array([regions[i].nbytes for i in order], dtype=np.int64)
        self.names = np.array(names, dtype=np.int64)[order]
        self.ends = self.names + sizes
        origin = int(addrs.min())
        self.local = addrs - origin
        top = int((addrs + sizes).max())
        first = regions[int(order[int(np.argmin(addrs))])]
        self.tensor = byte_tensor(Region(origin, top - origin, first.kind, first.device))
        self.bases = tuple(r.addr - origin for r in regions)
        """Each region's offset in :attr:`tensor`, in the order given: a plan made over
        these bases (:meth:`KernelMover.geometry`) addresses the tensor directly."""

    def check(
        self, off: np.ndarray, length: np.ndarray, what: str, lengths: tuple[int, int]
    ) -> None:
        """Runs of a plan made over :attr:`bases` (tensor offsets; ``lengths``: the
        shortest and longest of ``length``): one outside the tensor is a TransportError."""
        if not off.shape[0]:
            return
        top = self.tensor.shape[0]
        if int(off.min()) < 0 or lengths[0] <= 0 or int(off.max()) + lengths[1] > top:
            bad = np.flatnonzero((off < 0) | (length <= 0) | (off + length > top))
            if bad.shape[0]:  # else the quick bound was only loose
                i = int(bad[0])
                raise TransportError(
                    f"{what} run {i} [{int(off[i])}, +{int(length[i])}) lies outside "
                    f"its memory ({top} bytes)"
                )

    def check_grid(
        self, off: np.ndarray, ids: np.ndarray, stride: int, length: np.ndarray, what: str
    ) -> None:
        """:meth:`check` of a grid's runs (run ``(t, b)`` at ``off[t] + ids[b] ·
        stride``, ``length[t]`` bytes) from the extremes of ``off`` and ``ids`` (exact:
        every combination is a run); the grid is expanded only to name a run outside."""
        if not off.shape[0] or not ids.shape[0]:
            return
        a, b = int(ids.min()) * stride, int(ids.max()) * stride
        lo = int(off.min()) + min(a, b)
        hi = int((off + length).max()) + max(a, b)
        top = self.tensor.shape[0]
        if lo < 0 or int(length.min()) <= 0 or hi > top:
            runs = (off[:, None] + ids * stride).ravel()
            every = np.repeat(length, ids.shape[0])
            self.check(runs, every, what, (0, hi - int(runs.min())))  # the slow way: names it
            raise TransportError(  # int64 wrapped in the slow way: the bounds say it
                f"{what} runs span [{lo}, {hi}) of a grid, outside its memory ({top} bytes)"
            )

    def offsets(self, addr: np.ndarray, length: np.ndarray, what: str) -> np.ndarray:
        """Tensor offsets (int64) of runs at ``addr`` (names) of ``length`` bytes; a run
        whose length is outside ``(0, MAX_RUN)`` or that is not inside one region is a
        TransportError (the first such run named)."""
        addr = np.asarray(addr).astype(np.int64, copy=False)
        length = np.asarray(length).astype(np.int64, copy=False)  # 2⁶³ and up: negative
        idx, start, end = self._region_of(addr)
        bad_length = (length <= 0) | (length >= MAX_RUN)
        bad = (idx < 0) | bad_length
        bad |= addr + np.where(bad, 0, length) > end
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            n = int(length[i]) % (1 << 64)  # as the peer sent it (uint64)
            run = f"{what} run {i} [{int(addr[i]):#x}, +{n})"
            if bad_length[i]:
                bound = MAX_RUN.bit_length() - 1
                raise TransportError(f"{run}: its length {n} B is outside (0, 2^{bound}) B")
            raise TransportError(f"{run} lies in no region")
        if self.names.shape[0] == 1:
            return addr + (int(self.local[0]) - int(self.names[0]))
        return self.local[idx] + (addr - start)

    def _region_of(self, addr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(index, start, end)`` of the region whose start is the last ≤ ``addr[i]``
        (index -1: none; then start and end are those of region 0). Runs come region after
        region, and a search over unsorted keys is slow (16,384 runs: ~0.8 ms, ~0.1 ms
        sorted): every ``STRIDE``-th run is searched, the others only where its guess fails."""
        if self.names.shape[0] == 1:
            idx = np.where(addr >= self.names[0], 0, -1)
            return (
                idx,
                np.broadcast_to(self.names[0], addr.shape),
                np.broadcast_to(self.ends[0], addr.shape),
            )
        guess = np.repeat(np.searchsorted(self.names, addr[::STRIDE], side="right") - 1, STRIDE)
        idx = np.maximum(guess[: addr.shape[0]], 0)
        start, end = self.names[idx], self.ends[idx]
        miss = (addr < start) | (addr >= end)
        if miss.any():
            found = np.searchsorted(self.names, addr[miss], side="right") - 1
            idx[miss] = found
            start[miss], end[miss] = self.names[found], self.ends[found]
            idx[miss & (idx < 0)] = -1
        return idx, start, end


def equal_runs(
    d_off: np.ndarray, s_off: np.ndarray, length: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Runs as few groups of equal length as possible, for one copy call each:
    ``[(destination offsets, source offsets, bytes per run)]``. Joined runs of consecutive
    blocks (32 KiB, 64 KiB, 96 KiB, …) cut into pieces of their lengths' greatest common
    divisor are one group, one launch, not one per length."""
    n = int(length.shape[0])
    if n == 0:
        return []
    first = int(length[0])
    if bool((length == first).all()):
        return [(d_off, s_off, first)]
    piece = int(np.gcd.reduce(length))
    count = length // piece
    pieces = int(count.sum())
    if piece < MIN_PIECE or pieces > MAX_PIECES * n:
        return [(d_off[k], s_off[k], size) for k, size in by_length(length)]
    run = np.repeat(np.arange(n), count)
    step = (np.arange(pieces) - np.repeat(np.cumsum(count) - count, count)) * piece
    return [(d_off[run] + step, s_off[run] + step, piece)]


class LocalMemory:
    """Writable access to a rank's ``regions`` (one memory) by absolute address, with
    :meth:`scatter` and :meth:`gather`; every run is checked to lie inside one region
    before any byte moves. Host memory copies with numpy (:func:`copy_equal`), device
    memory with torch kernels (:func:`rows_copy`; on a GPU on this object's own stream,
    each call returning once its copies completed)."""

    def __init__(self, regions: list[Region]):
        self.span = Span(regions)
        self.host = regions[0].kind is MemKind.HOST
        on = self.span.tensor.device
        self.stream = torch.cuda.Stream(device=on) if on.type == "cuda" else None
        self._mem: Any = self.span.tensor.numpy() if self.host else self.span.tensor

    def scatter(self, dst: np.ndarray, src: Any, src_off: np.ndarray, length: np.ndarray) -> None:
        """Copy ``src[src_off[i] : + length[i]]`` (a slot's bytes: a numpy array on the
        host, else a byte tensor) to absolute address ``dst[i]``."""
        d_off = self.span.offsets(dst, length, "scatter destination")
        self._copy(self._mem, d_off, src, src_off, length)

    def gather(self, src: np.ndarray, dst: Any, dst_off: np.ndarray, length: np.ndarray) -> None:
        """Copy absolute address ``src[i]`` to ``dst[dst_off[i] : + length[i]]``:
        :meth:`scatter` reversed."""
        s_off = self.span.offsets(src, length, "gather source")
        self._copy(dst, dst_off, self._mem, s_off, length)

    def _copy(self, dst: Any, d_off: np.ndarray, src: Any, s_off: np.ndarray, length: Any) -> None:
        d_off, s_off = d_off.astype(np.int64, copy=False), s_off.astype(np.int64, copy=False)
        length = length.astype(np.int64, copy=False)
        if self.host:
            for k, size in by_length(length):
                copy_equal(dst, d_off[k], src, s_off[k], size)
            return
        try:
            for d, s, size in equal_runs(d_off, s_off, length):
                rows_copy(dst, d, src, s, size, stream=self.stream)
        finally:
            if self.stream is not None:
                self.stream.synchronize()
