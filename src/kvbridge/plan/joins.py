"""Per request: which links (:mod:`kvbridge.plan.links`) the ids realize, checked with
the written D ids by one sort per pool, and the merges that leave the fewest runs for
the byte map (``docs/planner.md``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import PlanError
from kvbridge.plan.links import Link
from kvbridge.plan.pattern import Pattern
from kvbridge.plan.runs import Runs, merge_adjacent
from kvbridge.plan.tables import SMALL

M = 1 << 32
FM = float(M)
BIG = 1024
"""Above this many keys, numpy's stable sort beats its default one."""
HALF = float(1 << 31)
"""Keys of one D id lie closer than this (P ids are below it), of two further."""
PAIR_LIMIT = 1 << 20
"""Paired pools have at most this many D blocks: keys stay exact in float64."""

Triple = tuple[np.ndarray, np.ndarray, np.ndarray]
Tab = tuple[np.ndarray, np.ndarray, int, int, int]
"""A group's P and D tables (whole tiles), the first tile the request moves, and the D
table entries ``[lo, hi)`` it writes."""
Keys = tuple[np.ndarray, list[int], tuple[bool, ...], bool]
"""A paired pool's sorted keys, the groups that wrote them, whether the gap between two
neighbours equals each of the pool's link values (the first: ``2³² + 1``, streaks), and
whether every gap does (one chain)."""


@dataclass(frozen=True, slots=True)
class Fast:
    """A link told by one gap count of its pool's keys: its group, pool, the index of its
    gap among the pool's link values (0: ``2³² + 1``, a streak's), and whether a streak."""

    group: int
    pool: int
    value: int
    streak: bool


def written_keys(tab: Tab, mode: int) -> np.ndarray:
    """The D ids a group writes: as they are (mode 0), as keys ``D · 2³² + P`` (1: one
    block per side and tile) or ``D · 2³²`` (2)."""
    ptab, dtab, _, lo, hi = tab
    if mode == 1:
        keys = dtab[lo:hi] * FM
        keys += ptab[lo:hi]
        return keys
    return dtab[lo:hi] * FM if mode else dtab[lo:hi]


def check_written(
    pool: int,
    gs: list[int],
    tabs: dict[int, Tab],
    modes: Sequence[int],
    limit: int,
    values: tuple[float, ...],
) -> Keys | None:
    """D block ids about to be written by groups ``gs`` of ``pool`` (keyed per
    ``modes[g]``; paired pools have no group of mode 0): in ``[0, limit)`` and each used
    once. Paired, the sorted keys, and whether a gap between two equals each of
    ``values``."""
    mode = modes[gs[0]]
    if len(gs) == 1:  # written_keys inline: the usual case, on every request
        ptab, dtab, _, lo, hi = tabs[gs[0]]
        if mode == 1:
            srt = dtab[lo:hi] * FM
            srt += ptab[lo:hi]
        else:
            srt = dtab[lo:hi] * FM if mode else dtab[lo:hi].copy()
    else:
        srt = np.concatenate([written_keys(tabs[g], modes[g]) for g in gs])
    srt.sort(kind="stable" if srt.shape[0] > BIG else None)
    if not mode:
        if srt[0] < 0 or srt[-1] >= limit:
            _range_error(gs, tabs, limit)
        if srt.shape[0] > 1 and np.count_nonzero(srt[1:] == srt[:-1]):
            _dup_error(srt, pool)
        return None
    if srt[0] < 0 or srt[-1] >= limit * FM:
        _range_error(gs, tabs, limit)
    gaps = srt[1:] - srt[:-1]
    n = gaps.shape[0]
    if n > SMALL:  # linear tests; below, sorting is cheaper
        if np.count_nonzero(gaps < HALF):
            _dup_error((srt // FM).astype(np.int64), pool)
        found = [int(np.count_nonzero(gaps == v)) for v in values]
        return srt, gs, tuple([x > 0 for x in found]), found[0] == n
    gaps.sort()  # the smallest tells a repeated D id
    if n and gaps[0] < HALF:
        _dup_error((srt // FM).astype(np.int64), pool)
    hits = []
    for v in values:
        i = gaps.searchsorted(v)
        hits.append(bool(i < n and gaps[i] == v))
    return srt, gs, tuple(hits), bool(hits[0] and gaps[0] == gaps[-1])


def _range_error(gs: list[int], tabs: dict[int, Tab], limit: int) -> None:
    ids = np.concatenate([tabs[g][1][tabs[g][3] : tabs[g][4]] for g in gs])
    raise PlanError(f"D block ids span [{ids.min()}, {ids.max()}]; valid are [0, {limit})")


def _dup_error(ids: np.ndarray, pool: int) -> None:
    same = ids[1:] == ids[:-1]
    raise PlanError(f"D block id {int(ids[1:][same][0])} is used twice (pool {pool})")


def realize(
    fast: tuple[Fast, ...],
    slow: tuple[Link, ...],
    keys: dict[int, Keys | None],
    tabs: dict[int, Tab],
    per_tile: Sequence[tuple[int, int]],
) -> tuple[set[int], bool]:
    """Groups whose streak links this request realizes, and whether it realizes any
    other link (``tabs``: the groups it moves; ``per_tile``: blocks per tile)."""
    streak: set[int] = set()
    other = False
    for f in fast:
        if f.group in tabs and keys[f.pool][2][f.value]:  # type: ignore[index]
            if f.streak:
                streak.add(f.group)
            else:
                other = True
    for ln in slow:
        if other:
            break
        if ln.g in tabs and ln.h in tabs:
            mine = _tiles(tabs[ln.g], per_tile[ln.g])
            other = _meet(ln, mine, _tiles(tabs[ln.h], per_tile[ln.h]))
    return streak, other


def _tiles(tab: Tab, per_tile: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    ptab, dtab, k0, _, _ = tab
    return ptab.reshape(-1, per_tile[0])[k0:], dtab.reshape(-1, per_tile[1])[k0:]


def _meet(
    ln: Link, mine: tuple[np.ndarray, np.ndarray], theirs: tuple[np.ndarray, np.ndarray]
) -> bool:
    """Some tile of ``mine`` and some tile of ``theirs`` hold ids ``(dp, dd)`` apart."""
    x = mine[0][:, ln.a] * M + mine[1][:, ln.a2] + (ln.dp * M + ln.dd)
    y = theirs[0][:, ln.b] * M + theirs[1][:, ln.b2]
    if y.shape[0] == 1 or x.shape[0] == 1:  # a state group's one slot
        return bool(np.count_nonzero(x == y))
    both = np.concatenate((x, y))  # each distinct (distinct ids): a repeat is a meeting
    both.sort()
    return bool(np.count_nonzero(both[1:] == both[:-1]))


def chains(srt: np.ndarray, one: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """Chains of sorted keys whose ids rise by one on both sides: the first key and the
    length of each; None if none. ``one``: known to be one chain."""
    if one:
        return srt[:1], np.array([srt.shape[0]])
    brk = (srt[1:] - srt[:-1]) != FM + 1
    nb = int(np.count_nonzero(brk))
    if nb == brk.shape[0]:
        return None
    if nb == 0:
        return srt[:1], np.array([srt.shape[0]])
    starts = np.empty(nb + 1, np.int64)
    starts[0] = 0
    starts[1:] = np.flatnonzero(brk) + 1
    counts = np.empty(nb + 1, np.int64)
    counts[:-1] = starts[1:] - starts[:-1]
    counts[-1] = srt.shape[0] - starts[-1]
    return srt[starts], counts


def streak_runs(pat: Pattern, first: np.ndarray, counts: np.ndarray) -> Triple:
    """A streakable pattern's runs over chains of tiles (first keys, lengths)."""
    if first.shape[0] == 1:
        d, p = divmod(int(first[0]), M)
        n = int(counts[0])
        return pat.soff + p * pat.sstr, pat.doff + d * pat.dstr, pat.length * n
    did = (first // FM).astype(np.int64)
    pid = first.astype(np.int64) - did * M
    src = addresses(pat.soff_c, pid, pat.sstride, pat.sstr_c)
    dst = addresses(pat.doff_c, did, pat.dstride, pat.dstr_c)
    return src, dst, (pat.len_c * counts).ravel()


def addresses(off_c: np.ndarray, ids: np.ndarray, stride: int, stride_c: np.ndarray) -> np.ndarray:
    """``off + id · stride`` for every (run, tile), flattened run-major."""
    if stride and ids.ndim == 1:
        return (off_c + ids * stride).ravel()
    return (off_c + ids * stride_c).ravel()


def merge_all(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> Runs:
    """Runs in destination order, each merged into its predecessor where both sides
    continue it: the fewest runs for these bytes."""
    order = dst.argsort(kind="stable" if dst.shape[0] > BIG else None)  # starts distinct
    return merge_adjacent(src[order], dst[order], length[order])
