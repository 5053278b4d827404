"""Staged rounds: runs sorted by source, joined into the spans one READ (or WRITE) moves
into a staging slot, and cut into rounds that fit the slot (:func:`chunks`; P's gather
for a staged push uses it keyed by destination). Runs whose sources touch or overlap
join; with ``max_gap`` runs up to that many bytes apart in one source region join too,
the span reading over the gap (``docs/performance.md``, staged pulls). :func:`rounds`
runs them through the two halves of a slot, pulled or pushed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from kvbridge.errors import TransportError
from kvbridge.plan.runs import Runs

Regions = tuple[np.ndarray, np.ndarray]
"""Sorted start addresses and end addresses of a source's registered regions."""


def regions_of(bases: Sequence[int], sizes: Sequence[int]) -> Regions:
    """:data:`Regions` of registered regions given by base address and size."""
    starts = np.array(bases, np.int64)
    order = np.argsort(starts, kind="stable")
    return starts[order], (starts + np.array(sizes, np.int64))[order]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One staged round: move ``spans`` into the slot, then copy ``runs`` out of it."""

    span_src: np.ndarray
    span_stage: np.ndarray
    """Offsets of the spans in the slot."""
    span_len: np.ndarray
    run_dst: np.ndarray
    run_stage: np.ndarray
    run_len: np.ndarray

    @property
    def staged_bytes(self) -> int:
        return int(self.span_len.sum())


def chunks(
    runs: Runs, slot_bytes: int, max_gap: int = 0, regions: Regions | None = None
) -> list[Chunk]:
    """Runs sorted by source, cut into rounds whose spans fit ``slot_bytes``; in a round,
    runs join into one span when their sources touch, overlap, or (``max_gap``) lie at
    most that many bytes apart in one of ``regions`` (no region given: no gap joins).
    Raises if a single run is longer than a slot (the caller sends such requests direct)."""
    order = np.argsort(runs.src, kind="stable")
    s, d, ln = runs.src[order], runs.dst[order], runs.length[order]
    if int(ln.max()) > slot_bytes:
        raise TransportError(f"a run of {int(ln.max())} B exceeds the {slot_bytes} B slot")
    end = np.maximum.accumulate(s + ln)
    join = _joins(s, end, max_gap if regions is not None else 0, regions)
    # bytes each run adds to the slot: the whole run at a span's start, else what it
    # extends the span by (its gap and itself, less any overlap); an estimate for a round
    # that starts inside a span, checked below
    grow = np.where(join, np.maximum(end - np.concatenate(([0], end[:-1])), 0), ln)
    total = np.cumsum(grow)
    out, lo = [], 0
    while lo < s.shape[0]:
        before = int(total[lo - 1]) if lo else 0
        hi = max(int(np.searchsorted(total, before + slot_bytes, side="right")), lo + 1)
        while True:
            part = join[lo:hi].copy()
            part[0] = False  # a round starts a span
            chunk = _chunk(s[lo:hi], d[lo:hi], ln[lo:hi], part)
            if chunk.staged_bytes <= slot_bytes or hi == lo + 1:
                break
            hi = lo + max(1, (hi - lo) * slot_bytes // chunk.staged_bytes)
        out.append(chunk)
        lo = hi
    return out


def _joins(s: np.ndarray, end: np.ndarray, max_gap: int, regions: Regions | None) -> np.ndarray:
    """Per run (sorted by source): does it join the span of the runs before it?"""
    join = np.zeros(s.shape[0], bool)
    join[1:] = s[1:] <= end[:-1]
    if regions is not None and s.shape[0] > 1:
        # never across regions, even where two lie back to back in address space
        reg = np.searchsorted(regions[0], s, side="right")
        join[1:] = (s[1:] <= end[:-1] + max(max_gap, 0)) & (reg[1:] == reg[:-1])
    return join


def _chunk(s: np.ndarray, d: np.ndarray, ln: np.ndarray, join: np.ndarray) -> Chunk:
    """One round of runs sorted by source: spans and each run's offset in the slot."""
    end = np.maximum.accumulate(s + ln)
    new = ~join
    starts = np.flatnonzero(new)
    span_id = np.cumsum(new) - 1
    span_src = s[starts]
    span_len = np.append(end[starts[1:] - 1], end[-1]) - span_src
    stage = np.concatenate(([0], np.cumsum(span_len)[:-1]))
    return Chunk(span_src, stage, span_len, d, stage[span_id] + (s - span_src[span_id]), ln)


T = TypeVar("T")
W = TypeVar("W")


def rounds(
    items: Sequence[T],
    half: int,
    start: Callable[[T, int], W],
    wait: Callable[[W], None],
    scatter: Callable[[T, int], None],
    inflight: list[W],
    wait_first: bool = False,
) -> None:
    """Staged rounds through a slot's two halves, pulled and pushed alike: round ``i``
    moves into the half at offset ``(i % 2) * half`` (``start``) while round ``i - 1``,
    once ``wait`` says it landed, is copied out of the other (``scatter``).
    ``wait_first``: round ``i - 1`` is waited for before round ``i`` starts (a start
    that cannot begin while the last is unanswered: a push's call to each P rank), else
    after (two READs in flight). ``inflight``: what was started and not yet waited for,
    oldest first (the caller's to fence, or answer, when this raises)."""
    prev: tuple[T, int] | None = None
    for i, item in enumerate(items):
        off = (i % 2) * half
        if prev is not None and wait_first:
            wait(inflight[0])
            inflight.pop(0)
        inflight.append(start(item, off))
        if prev is not None:
            if not wait_first:
                wait(inflight[0])
                inflight.pop(0)
            scatter(*prev)
        prev = (item, off)
    if prev is not None:
        wait(inflight[0])
        inflight.pop(0)
        scatter(*prev)
