"""Local copies of many equal-length runs with numpy: the gather and scatter of staged
transfers. Runs forming long arithmetic progressions on both sides are copied as 2-D
strided views, else as one gather-scatter over words as wide as every offset allows;
:func:`strided_limit` picks the cheaper (measurements: ``docs/performance.md``, Copies).
"""

from __future__ import annotations

import bisect
import itertools

import numpy as np

from kvbridge.errors import TransportError

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


def inside(name: str, nbytes: int, lo: int, hi: int, size: int) -> None:
    """TransportError unless runs of ``size`` bytes at offsets ``lo`` to ``hi`` lie inside
    the ``nbytes`` of the ``name`` buffer (destination or source)."""
    if lo < 0 or hi + size > nbytes:
        raise TransportError(
            f"{name} runs of {size} B at offsets {lo}..{hi} leave the {nbytes} B "
            f"{name} buffer (the highest ends at {hi + size})"
        )


def copy_equal(
    dv: np.ndarray, d_off: np.ndarray, sv: np.ndarray, s_off: np.ndarray, size: int
) -> None:
    """``dv[d_off[i] : +size] = sv[s_off[i] : +size]`` for all i (uint8 arrays; offsets
    of any integer dtype)."""
    if d_off.shape[0] == 0:
        return
    d_off, s_off = d_off.astype(np.int64, copy=False), s_off.astype(np.int64, copy=False)
    inside("destination", dv.shape[0], int(d_off.min()), int(d_off.max()), size)
    inside("source", sv.shape[0], int(s_off.min()), int(s_off.max()), size)
    if d_off.shape[0] <= 16 or size >= 1 << 16:  # few or long runs: slices
        for a, b in zip(d_off.tolist(), s_off.tolist(), strict=True):
            dv[a : a + size] = sv[b : b + size]
        return
    w = gather_word(d_off, s_off, size)
    spans = _progressions(d_off, s_off, size, w)
    if spans is None:
        gather_scatter(dv, d_off, sv, s_off, size, w)
    else:
        _strided(dv, d_off, sv, s_off, size, spans)


def gather_scatter(
    dv: np.ndarray, d_off: np.ndarray, sv: np.ndarray, s_off: np.ndarray, size: int, w: int
) -> None:
    """:func:`copy_equal` as one numpy gather-scatter over ``w``-byte words (``w``
    divides ``size`` and every offset, int64 offsets inside both arrays; a tail of either
    array shorter than a word is left out of its words)."""
    word = np.dtype((np.void, w))
    dw, sw = (v[: v.shape[0] - v.shape[0] % w].view(word) for v in (dv, sv))
    if w == size:
        dw[d_off // w] = sw[s_off // w]
        return
    step = np.arange(size // w, dtype=np.int64)
    dw[(d_off // w)[:, None] + step] = sw[(s_off // w)[:, None] + step]


def gather_word(d_off: np.ndarray, s_off: np.ndarray, size: int) -> int:
    """Bytes per word of :func:`copy_equal`'s gather-scatter of these runs: the widest
    that every offset and the run length are multiples of (``size``: a run is one word)."""
    return int(np.gcd.reduce(np.concatenate(([size], d_off, s_off))))


def _strided(
    dv: np.ndarray,
    d_off: np.ndarray,
    sv: np.ndarray,
    s_off: np.ndarray,
    size: int,
    spans: list[tuple[int, int]],
) -> None:
    """Copy runs forming the arithmetic progressions ``spans`` (:func:`_progressions`) on
    both sides as 2-D strided views, at memcpy speed."""
    first = np.array([a for a, _ in spans], dtype=np.int64)
    second = np.minimum(first + 1, d_off.shape[0] - 1)  # a single run's: never used
    d_l, s_l = d_off[first].tolist(), s_off[first].tolist()
    dd_l, ds_l = (d_off[second] - d_off[first]).tolist(), (s_off[second] - s_off[first]).tolist()
    for (_, m), a, b, da, db in zip(spans, d_l, s_l, dd_l, ds_l, strict=True):
        if m == 1:
            dv[a : a + size] = sv[b : b + size]
        elif abs(da) < size:  # destinations that overlap: in order, one run at a time
            for r in range(m):
                dv[a + r * da : a + r * da + size] = sv[b + r * db : b + r * db + size]
        else:  # ndarray(buffer=) costs a few µs a view; as_strided several times that
            rows = np.ndarray((m, size), np.uint8, dv, a, (da, 1))
            rows[...] = np.ndarray((m, size), np.uint8, sv, b, (db, 1))


def _progressions(
    d_off: np.ndarray, s_off: np.ndarray, size: int, word: int
) -> list[tuple[int, int]] | None:
    """Runs ``0..n-1`` cut greedily into arithmetic progressions on both sides ``(first
    run, runs)``: one from run i takes every run up to the first change of step after i.
    None: more than :func:`strided_limit` (one gather-scatter over ``word``-byte words is
    cheaper)."""
    n = d_off.shape[0]
    limit = strided_limit(n, size, word)
    dd, ds = np.diff(d_off), np.diff(s_off)
    cut = np.flatnonzero((dd[1:] != dd[:-1]) | (ds[1:] != ds[:-1])) + 1
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
    spans = _progressions(d_off, s_off, size, gather_word(d_off, s_off, size))
    return len(spans) if spans is not None else None
