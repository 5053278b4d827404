"""Local copies of many equal-length runs, as vectorised as numpy allows: the gather
and scatter of staged transfers (:mod:`kvbridge.connector.staging`,
:mod:`kvbridge.connector.push_gather`).

Runs that form long arithmetic progressions on both sides (a block's rows, sorted) are
copied as 2-D strided views, one per progression; else one gather-scatter over words as
wide as every offset allows (a whole run when offsets are multiples of its length).
Which is cheaper is :func:`strided_limit`'s call: a view costs a few µs, a run of the
gather-scatter tens to hundreds of ns, so short progressions of short runs gather.
Measured (2026-11-25, this VM, 65,536 runs of 1 KiB): progressions of 16 rows in
shuffled block order 57 → 22 ms (views made with ``np.ndarray(buffer=)`` instead of
``as_strided``, a progression no longer split at each block's first row), shuffled runs
80 → 30 ms (1 KiB words instead of 8-byte ones), a memcpy of the same 64 MiB 4.7 ms.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools

import numpy as np

from kvbridge.errors import TransportError
from kvbridge.transport.base import Region

VIEW_S = 3.4e-6
"""Fixed cost of one strided copy (two ``np.ndarray(buffer=)`` views and the assignment)."""
GATHER_RUN_S = 15e-9
GATHER_BYTE_S = 0.045e-9
"""What the gather-scatter costs per run, and per byte beyond a strided copy's cost.
Measured on the development VM (``tools/bench_copies.py``): progressions of 16 runs of
1 KiB copy in 1.8 ms per 8 MiB gathered, 2.9 ms as views; of 48 runs, equal."""


def strided_limit(runs: int, size: int) -> int:
    """The most progressions for which ``runs`` runs of ``size`` bytes copy faster as
    strided views than as one gather-scatter."""
    return int(runs * (GATHER_RUN_S + size * GATHER_BYTE_S) / VIEW_S)


class LocalMemory:
    """Writable numpy views of local regions, addressed by absolute address."""

    def __init__(self, regions: list[Region]):
        order = sorted(regions, key=lambda r: r.addr)
        self.bases = np.array([r.addr for r in order], dtype=np.int64)
        self.ends = self.bases + np.array([r.nbytes for r in order], dtype=np.int64)
        self.views = [
            np.ctypeslib.as_array((ctypes.c_uint8 * r.nbytes).from_address(r.addr)) for r in order
        ]

    def scatter(
        self, dst: np.ndarray, src: np.ndarray, src_off: np.ndarray, length: np.ndarray
    ) -> None:
        """Copy ``src[src_off[i] : src_off[i] + length[i]]`` to absolute address ``dst[i]``
        (each destination inside one region, checked)."""
        dst, src_off = dst.astype(np.int64, copy=False), src_off.astype(np.int64, copy=False)
        for r, k, size in self._groups(dst, length, "scatter"):
            copy_equal(self.views[r], dst[k] - self.bases[r], src, src_off[k], size)

    def gather(
        self, src: np.ndarray, dst: np.ndarray, dst_off: np.ndarray, length: np.ndarray
    ) -> None:
        """Copy absolute address ``src[i]`` (``length[i]`` bytes, inside one region,
        checked) to ``dst[dst_off[i] : dst_off[i] + length[i]]``: :meth:`scatter` reversed."""
        src, dst_off = src.astype(np.int64, copy=False), dst_off.astype(np.int64, copy=False)
        for r, k, size in self._groups(src, length, "gather"):
            copy_equal(dst, dst_off[k], self.views[r], src[k] - self.bases[r], size)

    def _groups(
        self, addr: np.ndarray, length: np.ndarray, what: str
    ) -> list[tuple[int, np.ndarray | slice, int]]:
        """The runs per (region, length), each group in the order given: ``(region,
        indices or a slice of them, length)``; TransportError if a run leaves its region."""
        reg = np.searchsorted(self.bases, addr, side="right") - 1
        length = length.astype(np.int64, copy=False)
        if (length <= 0).any() or (length >= 1 << 40).any():
            raise TransportError(f"staged {what}: a run length outside (0, 2⁴⁰) B")
        if (reg < 0).any() or (addr + length > self.ends[np.maximum(reg, 0)]).any():
            raise TransportError(f"staged {what}: a run leaves local memory")
        if reg.shape[0] == 0:
            return []
        # one key per (region, length): lengths below 2⁴⁰ B, regions below 2²³
        key = (reg << 40) | length
        if key.shape[0] == 1 or bool((key[1:] >= key[:-1]).all()):
            order: np.ndarray | None = None  # grouped already (one region and length: often)
        else:
            order = np.argsort(key, kind="stable")
            key = key[order]
        cut = np.flatnonzero(key[1:] != key[:-1]) + 1
        bounds = [0, *cut.tolist(), int(key.shape[0])]
        out: list[tuple[int, np.ndarray | slice, int]] = []
        for lo, hi in itertools.pairwise(bounds):
            k: np.ndarray | slice = slice(lo, hi) if order is None else order[lo:hi]
            out.append((int(key[lo] >> 40), k, int(key[lo] & ((1 << 40) - 1))))
        return out


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
    if _strided(dv, d_off, sv, s_off, size):
        return
    # One gather-scatter over words of the widest size every offset and the run length
    # are multiples of (a run is one word when its offsets are multiples of its size).
    w = int(np.gcd.reduce(np.concatenate(([size], d_off, s_off))))
    word = np.dtype((np.void, w))
    dw, sw = _words(dv, w, word), _words(sv, w, word)
    if w == size:
        dw[d_off // w] = sw[s_off // w]
        return
    step = np.arange(size // w, dtype=np.int64)
    dw[(d_off // w)[:, None] + step] = sw[(s_off // w)[:, None] + step]


def _words(v: np.ndarray, w: int, word: np.dtype) -> np.ndarray:
    """``v`` (uint8, contiguous) as whole words of ``w`` bytes (a tail shorter than a
    word left out: the offsets were checked to lie inside ``v``)."""
    return v[: v.shape[0] - v.shape[0] % w].view(word)


def _inside(v: np.ndarray, off: np.ndarray, size: int) -> None:
    if int(off.min()) < 0 or int(off.max()) + size > v.shape[0]:
        raise TransportError(f"copy of {size} B runs outside a {v.shape[0]} B buffer")


def _strided(
    dv: np.ndarray, d_off: np.ndarray, sv: np.ndarray, s_off: np.ndarray, size: int
) -> bool:
    """Copy runs that form arithmetic progressions on both sides (a block's rows, sorted)
    as 2-D strided views, at memcpy speed; False (nothing copied) if the runs form too
    many progressions (:func:`strided_limit`: the caller's gather-scatter is cheaper)."""
    n = d_off.shape[0]
    dd, ds = np.diff(d_off), np.diff(s_off)
    spans = _segments(_cuts(dd, ds), n, strided_limit(n, size))
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
    spans = _segments(_cuts(np.diff(d_off), np.diff(s_off)), n, strided_limit(n, size))
    return len(spans) if spans is not None else None
