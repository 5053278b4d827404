"""Local copies of many equal-length runs with numpy: the gather and scatter of staged
transfers. Runs forming long arithmetic progressions on both sides are copied as 2-D
strided views, else as one gather-scatter over words as wide as every offset allows;
:func:`strided_limit` picks the cheaper (measurements: ``docs/performance.md``, Copies).
"""

from __future__ import annotations

import bisect
import ctypes
import itertools

import numpy as np

from kvbridge.errors import TransportError
from kvbridge.transport.base import Region

PAGE = 4096
VIEW_S = 3.4e-6
"""Fixed cost of one strided copy (two ``np.ndarray(buffer=)`` views and the assignment)."""
GATHER_RUN_S = 15e-9
GATHER_BYTE_S = 0.045e-9
"""What the gather-scatter costs per word, and per byte beyond a strided copy's cost;
fitted to ``benchmarks/bench_copies.py``'s table on the development VM (see above)."""


def strided_limit(runs: int, size: int, word: int) -> int:
    """The most progressions for which ``runs`` runs of ``size`` bytes copy faster as
    strided views than as one gather-scatter over ``word``-byte words (a run is
    ``size // word`` of them: 8-byte words cost about 0.5 GB/s, whole 1 KiB runs 5)."""
    return int(runs * (size // word) * (GATHER_RUN_S + word * GATHER_BYTE_S) / VIEW_S)


class LocalMemory:
    """Writable numpy access to local regions, addressed by absolute address, through one
    uint8 view spanning them all (one copy call per run length, whatever the region:
    ``docs/performance.md``, Copies); only bytes of checked runs are touched through it."""

    def __init__(self, regions: list[Region]):
        order = sorted(regions, key=lambda r: r.addr)
        self.bases = np.array([r.addr for r in order], dtype=np.int64)
        self.ends = self.bases + np.array([r.nbytes for r in order], dtype=np.int64)
        self.origin = int(self.bases[0]) & ~(PAGE - 1) if order else 0
        self.view = np.empty(0, np.uint8)  # no regions: every run is refused
        if order:
            span = ctypes.c_uint8 * (int(self.ends.max()) - self.origin)
            self.view = np.ctypeslib.as_array(span.from_address(self.origin))

    def scatter(
        self, dst: np.ndarray, src: np.ndarray, src_off: np.ndarray, length: np.ndarray
    ) -> None:
        """Copy ``src[src_off[i] : src_off[i] + length[i]]`` to absolute address ``dst[i]``
        (each destination inside one region, checked)."""
        dst, src_off = dst.astype(np.int64, copy=False), src_off.astype(np.int64, copy=False)
        for k, size in self._groups(dst, length, "scatter"):
            copy_equal(self.view, dst[k] - self.origin, src, src_off[k], size)

    def gather(
        self, src: np.ndarray, dst: np.ndarray, dst_off: np.ndarray, length: np.ndarray
    ) -> None:
        """Copy absolute address ``src[i]`` (``length[i]`` bytes, inside one region,
        checked) to ``dst[dst_off[i] : dst_off[i] + length[i]]``: :meth:`scatter` reversed."""
        src, dst_off = src.astype(np.int64, copy=False), dst_off.astype(np.int64, copy=False)
        for k, size in self._groups(src, length, "gather"):
            copy_equal(dst, dst_off[k], self.view, src[k] - self.origin, size)

    def _groups(
        self, addr: np.ndarray, length: np.ndarray, what: str
    ) -> list[tuple[np.ndarray | slice, int]]:
        """The runs per length, each group in the order given: ``(indices or a slice of
        them, length)``; TransportError if a run leaves its region."""
        reg = np.searchsorted(self.bases, addr, side="right") - 1
        length = length.astype(np.int64, copy=False)
        if (length <= 0).any() or (length >= 1 << 40).any():
            raise TransportError(f"staged {what}: a run length outside (0, 2⁴⁰) B")
        if (reg < 0).any() or (addr + length > self.ends[np.maximum(reg, 0)]).any():
            raise TransportError(f"staged {what}: a run leaves local memory")
        return by_length(length)


def by_length(length: np.ndarray) -> list[tuple[np.ndarray | slice, int]]:
    """Runs grouped by length: ``(indices or a slice, length)``, each group in run order."""
    if length.shape[0] == 0:
        return []
    if bool((length == length[0]).all()):  # one length: the common case
        return [(slice(0, length.shape[0]), int(length[0]))]
    order = np.argsort(length, kind="stable")
    key = length[order]
    cut = np.flatnonzero(key[1:] != key[:-1]) + 1
    bounds = [0, *cut.tolist(), int(key.shape[0])]
    return [(order[lo:hi], int(key[lo])) for lo, hi in itertools.pairwise(bounds)]


def copy_equal(
    dv: np.ndarray, d_off: np.ndarray, sv: np.ndarray, s_off: np.ndarray, size: int
) -> None:
    """``dv[d_off[i] : +size] = sv[s_off[i] : +size]`` for all i (uint8 arrays; offsets
    of any integer dtype)."""
    if d_off.shape[0] == 0:
        return
    d_off, s_off = d_off.astype(np.int64, copy=False), s_off.astype(np.int64, copy=False)
    _inside(dv, d_off, size)
    _inside(sv, s_off, size)
    if d_off.shape[0] <= 16 or size >= 1 << 16:  # few or long runs: slices
        for a, b in zip(d_off.tolist(), s_off.tolist(), strict=True):
            dv[a : a + size] = sv[b : b + size]
        return
    w = gather_word(d_off, s_off, size)
    if not _strided(dv, d_off, sv, s_off, size, w):
        gather_scatter(dv, d_off, sv, s_off, size, w)


def gather_scatter(
    dv: np.ndarray, d_off: np.ndarray, sv: np.ndarray, s_off: np.ndarray, size: int, w: int
) -> None:
    """:func:`copy_equal` as one numpy gather-scatter over ``w``-byte words (``w``
    divides ``size`` and every offset, int64 offsets inside both arrays)."""
    word = np.dtype((np.void, w))
    dw, sw = _words(dv, w, word), _words(sv, w, word)
    if w == size:
        dw[d_off // w] = sw[s_off // w]
        return
    step = np.arange(size // w, dtype=np.int64)
    dw[(d_off // w)[:, None] + step] = sw[(s_off // w)[:, None] + step]


def gather_word(d_off: np.ndarray, s_off: np.ndarray, size: int) -> int:
    """Bytes per word of :func:`copy_equal`'s gather-scatter of these runs: the widest
    that every offset and the run length are multiples of (``size``: a run is one word)."""
    return int(np.gcd.reduce(np.concatenate(([size], d_off, s_off))))


def _words(v: np.ndarray, w: int, word: np.dtype) -> np.ndarray:
    """``v`` (uint8, contiguous) as whole words of ``w`` bytes (a tail shorter than a
    word left out: the offsets were checked to lie inside ``v``)."""
    return v[: v.shape[0] - v.shape[0] % w].view(word)


def _inside(v: np.ndarray, off: np.ndarray, size: int) -> None:
    if int(off.min()) < 0 or int(off.max()) + size > v.shape[0]:
        raise TransportError(f"copy of {size} B runs outside a {v.shape[0]} B buffer")


def _strided(
    dv: np.ndarray, d_off: np.ndarray, sv: np.ndarray, s_off: np.ndarray, size: int, word: int
) -> bool:
    """Copy runs that form arithmetic progressions on both sides (a block's rows, sorted)
    as 2-D strided views, at memcpy speed; False (nothing copied) if the runs form too
    many progressions (:func:`strided_limit`: the caller's gather-scatter is cheaper)."""
    n = d_off.shape[0]
    dd, ds = np.diff(d_off), np.diff(s_off)
    spans = _segments(_cuts(dd, ds), n, strided_limit(n, size, word))
    if spans is None:
        return False
    first = np.array([a for a, _ in spans], dtype=np.int64)
    dd = np.append(dd, size)  # the step of a last single run: never used for a copy
    d_l, s_l, dd_l, ds_l = (a[first].tolist() for a in (d_off, s_off, dd, np.append(ds, 0)))
    for (_, m), a, b, da, db in zip(spans, d_l, s_l, dd_l, ds_l, strict=True):
        if m == 1:
            dv[a : a + size] = sv[b : b + size]
        elif abs(da) < size:  # destinations that overlap: in order, one run at a time
            for r in range(m):
                dv[a + r * da : a + r * da + size] = sv[b + r * db : b + r * db + size]
        else:  # ndarray(buffer=) costs a few µs a view; as_strided several times that
            rows = np.ndarray((m, size), np.uint8, dv, a, (da, 1))
            rows[...] = np.ndarray((m, size), np.uint8, sv, b, (db, 1))
    return True


def _cuts(dd: np.ndarray, ds: np.ndarray) -> np.ndarray:
    """Where the step between consecutive runs changes, on either side."""
    return np.flatnonzero((dd[1:] != dd[:-1]) | (ds[1:] != ds[:-1])) + 1


def _segments(cut: np.ndarray, n: int, limit: int) -> list[tuple[int, int]] | None:
    """Runs ``0..n-1`` cut greedily into progressions ``(first run, runs)``: one from
    run i takes every run up to the first cut after i. None: more than ``limit``."""
    if cut.shape[0] > 2 * limit + 1:  # each progression spans at most two cuts
        return None
    cuts = cut.tolist()  # c: step c (run c → c+1) differs from step c-1
    spans: list[tuple[int, int]] = []
    i = 0
    while i < n:
        k = bisect.bisect_right(cuts, i)
        end = cuts[k] if k < len(cuts) else n - 1
        spans.append((i, end - i + 1))
        if len(spans) > limit:
            return None
        i = end + 1
    return spans


def progressions(d_off: np.ndarray, s_off: np.ndarray, size: int) -> int | None:
    """How many strided copies :func:`copy_equal` makes of these runs of ``size`` bytes
    (in order); None when it gathers them instead (:func:`strided_limit`)."""
    n = int(d_off.shape[0])
    if n < 3:
        return n
    limit = strided_limit(n, size, gather_word(d_off, s_off, size))
    spans = _segments(_cuts(np.diff(d_off), np.diff(s_off)), n, limit)
    return len(spans) if spans is not None else None
