"""Which runs of a request may continue each other on both sides (links between
whole-tile templates): found once per pair (``docs/planner.md``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.plan.pattern import Bucket

MAX_PAIRS = 1 << 20
"""Template pairs listed at most; beyond, every request is merged (exact, slower)."""

_COLS = ("g", "a", "a2", "s", "S", "d", "D", "L", "st")


@dataclass(frozen=True, slots=True)
class Link:
    """Runs of group ``g`` (P block bit ``a``, D bit ``a2``) continued by runs of group
    ``h`` (bits ``b``, ``b2``) whose ids lie ``dp`` (P) and ``dd`` (D) further."""

    g: int
    a: int
    a2: int
    h: int
    b: int
    b2: int
    dp: int
    dd: int
    streak: bool
    """Every template pair of it is one template followed by itself a block further on
    both sides (it fills its block stride): joining streaks of tiles merges it."""


@dataclass(frozen=True, slots=True)
class RankLinks:
    """Every link among one source rank's runs."""

    links: tuple[Link, ...] = ()
    always: bool = False
    """Runs may continue whatever the ids (two buckets' runs in the same blocks,
    templates of unequal strides sharing memory, or too many pairs to list): every
    request is sorted and merged."""


def rank_links(
    buckets: Sequence[Bucket], tiles: Sequence[int], p_blocks: np.ndarray, d_blocks: np.ndarray
) -> RankLinks:
    """Links among the whole-tile templates of one source rank's buckets (at least one);
    ``p_blocks``, ``d_blocks``: valid P and D ids per group."""
    t = _templates(buckets, tiles)
    if t["s"].shape[0] == 0:
        return RankLinks()
    pairs = _equal_stride_pairs(t)
    if pairs is None:
        return RankLinks((), True)
    links, always = _classify(t, pairs[0], pairs[1], p_blocks, d_blocks)
    return RankLinks(links, always or _unequal_strides_meet(t, p_blocks, d_blocks))


def _templates(buckets: Sequence[Bucket], tiles: Sequence[int]) -> dict[str, np.ndarray]:
    cols: dict[str, list[np.ndarray]] = {k: [] for k in _COLS}
    for b in buckets:
        pat = b.pattern(0, tiles[b.group])
        n = pat.length.shape[0]
        vals = (pat.p_bit, pat.d_bit, pat.soff, pat.sstr, pat.doff, pat.dstr, pat.length)
        cols["g"].append(np.full(n, b.group, np.int64))
        for k, v in zip(_COLS[1:8], vals, strict=True):
            cols[k].append(v)
        cols["st"].append(np.full(n, pat.streakable and b.single))
    return {k: np.concatenate(v) for k, v in cols.items()}


def _equal_stride_pairs(t: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray] | None:
    """Every (i, j) whose end and start agree modulo equal strides on both sides."""
    s, d, ln, ss, ds = t["s"], t["d"], t["L"], t["S"], t["D"]
    n = s.shape[0]
    ends = np.stack((ss, ds, (s + ln) % ss, (d + ln) % ds), axis=1)
    starts = np.stack((ss, ds, s % ss, d % ds), axis=1)
    _, inv = unique_rows(np.concatenate((ends, starts)))
    ek, sk = inv[:n], inv[n:]
    order = np.argsort(sk, kind="stable")
    lo = np.searchsorted(sk[order], ek, "left")
    cnt = np.searchsorted(sk[order], ek, "right") - lo
    total = int(cnt.sum())
    if total > MAX_PAIRS:
        return None
    i = np.repeat(np.arange(n), cnt)
    within = np.arange(total) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    return i, order[np.repeat(lo, cnt) + within]


def _classify(
    t: dict[str, np.ndarray], i: np.ndarray, j: np.ndarray, plim: np.ndarray, dlim: np.ndarray
) -> tuple[tuple[Link, ...], bool]:
    """Relations the ids could realize, one :class:`Link` each; and whether some pair
    continues whatever the ids (same blocks, two buckets)."""
    g, h = t["g"][i], t["g"][j]
    a, b, a2, b2 = t["a"][i], t["a"][j], t["a2"][i], t["a2"][j]
    dp = (t["s"][i] + t["L"][i] - t["s"][j]) // t["S"][i]
    dd = (t["d"][i] + t["L"][i] - t["d"][j]) // t["D"][i]
    ok = (dp < plim[h]) & (dp > -plim[g]) & (dd < dlim[h]) & (dd > -dlim[g])
    same = g == h  # one table: distinct ids, so a zero step means the same block
    ok &= ~(same & (dp == 0) & ((a != b) | ((dd != 0) & (a2 == b2))))
    ok &= ~(same & (dd == 0) & ((a2 != b2) | ((dp != 0) & (a == b))))
    fixed = ok & same & (dp == 0) & (dd == 0)  # same blocks: ids cannot tell
    streak = (i == j) & t["st"][i] & (dp == 1) & (dd == 1)
    rows = np.stack((g, a, a2, h, b, b2, dp, dd), axis=1)[ok & ~fixed]
    flags = streak[ok & ~fixed]
    links: list[Link] = []
    if rows.shape[0]:
        uniq, inv = unique_rows(rows)
        all_streak = np.ones(uniq.shape[0], bool)
        np.logical_and.at(all_streak, inv, flags)
        for row, st in zip(uniq.tolist(), all_streak.tolist(), strict=True):
            g_, a_, a2_, h_, b_, b2_, dp_, dd_ = row
            links.append(Link(g_, a_, a2_, h_, b_, b2_, dp_, dd_, st))
    return tuple(links), bool(fixed.any())


def _unequal_strides_meet(t: dict[str, np.ndarray], plim: np.ndarray, dlim: np.ndarray) -> bool:
    """Whether a template's end may meet the start of one with other strides, on both
    sides (conservative: address ranges over every valid id, not single ids)."""
    keys = np.stack((t["S"], t["D"]), axis=1)
    uniq, inv = unique_rows(keys)
    if uniq.shape[0] < 2:
        return False
    s_lo, d_lo = t["s"], t["d"]
    s_hi, d_hi = s_lo + (plim[t["g"]] - 1) * t["S"], d_lo + (dlim[t["g"]] - 1) * t["D"]
    ln = t["L"]
    for c in range(uniq.shape[0]):
        mine, other = inv == c, inv != c
        p_hit = _meets(s_lo[mine] + ln[mine], s_hi[mine] + ln[mine], s_lo[other], s_hi[other])
        d_hit = _meets(d_lo[mine] + ln[mine], d_hi[mine] + ln[mine], d_lo[other], d_hi[other])
        if (p_hit & d_hit).any():
            return True
    return False


def unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(rows, axis=0, return_inverse=True)`` for a 2-D integer array, without
    sorting rows as opaque records (seconds for 10⁶ rows): rows become one int64 key
    where the columns' ranges allow, else are sorted column by column."""
    n, k = rows.shape
    if n == 0:
        return rows[:0], np.zeros(0, np.int64)
    lo, hi = rows.min(axis=0), rows.max(axis=0)
    span = [int(h) - int(lo_) + 1 for lo_, h in zip(lo.tolist(), hi.tolist(), strict=True)]
    if np.prod(np.array(span, dtype=np.float64)) < 2.0**62:
        key = rows[:, 0].astype(np.int64) - int(lo[0])
        for c in range(1, k):
            key *= span[c]
            key += rows[:, c].astype(np.int64) - int(lo[c])
        order = np.argsort(key)
        srt = key[order, None]
    else:
        order = np.lexsort(rows.T[::-1])
        srt = rows[order]
    new = np.empty(n, bool)
    new[0] = True
    new[1:] = (srt[1:] != srt[:-1]).any(axis=1)
    inv = np.empty(n, np.int64)
    inv[order] = np.cumsum(new) - 1
    return rows[order[new]], inv


def _meets(lo: np.ndarray, hi: np.ndarray, olo: np.ndarray, ohi: np.ndarray) -> np.ndarray:
    """Per interval ``[lo, hi]``: does it meet the union of ``[olo, ohi]``?"""
    order = np.argsort(olo)
    olo, ohi = olo[order], np.maximum.accumulate(ohi[order])
    k = np.searchsorted(olo, hi, "right") - 1  # last other interval starting ≤ hi
    return (k >= 0) & (ohi[np.maximum(k, 0)] >= lo)
